"""The config reader against random types and values for every key: each config is either refused with one
ConfigError line or accepted, and an accepted config that fits the fixture's weights gives finite logits."""
import copy
import json

import numpy as np
from hypothesis import HealthCheck, event, given, settings, strategies as st

from conftest import REAL_RATIOS
from dsv4rt.config import ConfigError, from_dict
from dsv4rt.loader import Checkpoint, expected_shapes
from dsv4rt.reference import Model, Numerics, checkpoint_weights

BASE = json.loads((REAL_RATIOS / "config.json").read_text())
with Checkpoint.open(REAL_RATIOS) as _ck:
    WEIGHTS = checkpoint_weights(_ck)
SHAPES = {n: w.shape for n, w in WEIGHTS.items()}
IDS = np.random.default_rng(0).integers(0, BASE["vocab_size"], 40)

# the legacy spelling's keys, which BASE (the Hugging Face spelling) lacks, are fuzzed too
LEGACY = {"compress_ratios": [128, 0, 4, 128, 4], "num_hash_layers": 2, "qk_rope_head_dim": 16,
          "compress_rate_csa": 4, "compress_rate_hca": 128,
          "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                           "beta_fast": 32, "beta_slow": 1}}


def _paths(value, prefix=()):
    """Every key and every nested key of a config, as paths."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, prefix + (i,))


PATHS = [p for p in _paths(dict(BASE, **LEGACY)) if p]

_any_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6) | st.just(10 ** 400),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8)


def _near(value):
    """Values a plausible config might hold instead of `value`: the edges of each key's range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return st.nothing()
    ints = st.integers(-2, 2) | st.integers(-2 * abs(int(value)) - 2, 2 * abs(int(value)) + 2) | st.just(2 ** 31)
    floats = st.sampled_from([0.0, -0.0, 1e-300, 1e300, 1.0, float("nan"), float("inf"), -float("inf")])
    return ints | floats | st.floats(-4 * abs(value) - 4, 4 * abs(value) + 4) | st.just(value * 0.5)


def _fits(node, key) -> bool:
    """Whether key addresses a place in node (an earlier draw may have made a dict a list, or the reverse)."""
    if isinstance(node, list):
        return isinstance(key, int) and key < len(node)
    return isinstance(node, dict)


def _set(config: dict, path: tuple, value) -> None:
    node = config
    for key in path[:-1]:
        if not _fits(node, key):
            return
        if isinstance(node, dict) and key not in node:
            node[key] = {}
        node = node[key]
    if _fits(node, path[-1]):
        node[path[-1]] = value


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_configs_are_refused_in_one_line_or_give_finite_logits(data):
    config = copy.deepcopy(BASE)
    if data.draw(st.booleans()):
        config.update(copy.deepcopy(LEGACY))
        for key in data.draw(st.lists(st.sampled_from(["layer_types", "mlp_layer_types", "rope_parameters",
                                                       "partial_rotary_factor"]), unique=True)):
            config.pop(key)
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(PATHS))
        node = dict(BASE, **LEGACY)
        for key in path:
            node = node[key]
        _set(config, path, data.draw(_near(node) | _any_json))
    try:
        cfg = from_dict(config)
    except ConfigError as e:
        assert "\n" not in str(e) and str(e).startswith(("key '", "missing key '")), str(e)
        event("refused")
        return
    if expected_shapes(cfg) != SHAPES:
        event("accepted, other weight shapes")
        return
    event("accepted, forward run")
    numerics = data.draw(st.sampled_from(["exact", "faithful"]))
    logits = Model(cfg, WEIGHTS, Numerics.named(numerics), frozenset()).logits_chunked(IDS, None)
    assert np.isfinite(logits).all(), config
