"""The reference run rank by rank on the shards, collectives simulated, equals the unsharded reference."""
import json

import numpy as np
import pytest

from conftest import FIXTURES, TINY_A, rel_rows
from dsv4rt.config import from_dict
from dsv4rt.loader import Checkpoint, expected_shapes
from dsv4rt.parallel import LayoutError
from dsv4rt.parallel.reference import ShardedReference
from dsv4rt.reference import Model, Numerics, checkpoint_weights
from dsv4rt.reference.quant import act_quant
from dsv4rt.tiny import released_format

CASES = [(name, n, split) for name in ("tiny-a", "real-ratios") for n in (2, 4) for split in (True, False)]


def fixture(name):
    with Checkpoint.open(FIXTURES / name) as ck:
        return ck.config, checkpoint_weights(ck), np.load(FIXTURES / name / "golden.npz")


def incremental(model, ids, split):
    """Last-position logits of a `split`-token prefill, then of each single-token step."""
    st = model.new_state()
    return np.stack([model.forward(st, ids[:split])[-1]] +
                    [model.forward(st, ids[i:i + 1])[-1] for i in range(split, len(ids))])


@pytest.mark.parametrize("name, n, split_tokens", CASES)
def test_chunked_prefill_matches_the_unsharded_reference(name, n, split_tokens):
    cfg, W, g = fixture(name)
    want = Model(cfg, W).logits_chunked(g["input_ids"], g["chunks"])
    got = ShardedReference(cfg, W, n, split_tokens=split_tokens).logits_chunked(g["input_ids"], g["chunks"])
    assert rel_rows(got, want).max() < 1e-5
    assert rel_rows(got, g["logits_chunked"]).max() < 1e-5


@pytest.mark.parametrize("name, n, split_tokens", CASES)
def test_token_by_token_matches_the_unsharded_reference(name, n, split_tokens):
    cfg, W, g = fixture(name)
    ids, split = g["input_ids"], int(g["split"])
    got = incremental(ShardedReference(cfg, W, n, split_tokens=split_tokens), ids, split)
    assert rel_rows(got, incremental(Model(cfg, W), ids, split)).max() < 1e-5
    assert rel_rows(got, g["logits_incr"]).max() < 1e-5


@pytest.mark.parametrize("n", [2, 4])
def test_faithful_cache_roundings_shard_too(n):
    cfg, W, g = fixture("tiny-a")
    faithful = Numerics.named("faithful")
    want = Model(cfg, W, faithful).logits_chunked(g["input_ids"], g["chunks"])
    got = ShardedReference(cfg, W, n, faithful).logits_chunked(g["input_ids"], g["chunks"])
    assert rel_rows(got, want).max() < 1e-5


def random_weights(cfg, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith("tid2eid"):
            out[name] = np.stack([rng.permutation(cfg.n_experts)[:shape[1]] for _ in range(shape[0])])
        elif name.endswith(("norm.weight", "_scale")):
            out[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    return out


def aligned_model(n, numerics="faithful"):
    """tiny-a's shape with o_lora 256: wo_b's 512 input columns split into whole 128-blocks on 2 and 4 GPUs."""
    cfg = from_dict(json.loads((TINY_A / "config.json").read_text()) | {"o_lora_rank": 256})
    W = random_weights(cfg)
    quantized = frozenset(k for k in W if released_format(k) in ("fp8", "fp4"))
    rounded = Numerics.named(numerics)
    return cfg, Model(cfg, W, rounded, quantized), ShardedReference(cfg, W, n, rounded, quantized)


@pytest.mark.parametrize("n", [2, 4])
def test_act_quant_of_wo_b_inputs_is_the_same_on_each_ranks_columns(n):
    cfg, _, sharded = aligned_model(n)
    t = np.random.default_rng(2).standard_normal((7, cfg.o_groups * cfg.o_lora_rank)).astype(np.float32) * 30
    t[:, ::128] = 3000   # one outlier per block sets its scale
    columns = [sharded.layout.wo_b_columns(r) for r in range(n)]
    assert np.array_equal(np.concatenate([act_quant(t[:, a:b]) for a, b in columns], axis=1), act_quant(t))
    # what the refusal below guards against: blocks cut in half round differently
    assert not np.array_equal(np.concatenate([act_quant(t[:, a:a + 64]) for a in range(0, t.shape[1], 64)], axis=1),
                              act_quant(t))


@pytest.mark.parametrize("n, split_tokens, numerics", [(2, True, "faithful"), (2, False, "faithful"),
                                                       (4, True, "faithful"), (4, False, "faithful"),
                                                       (2, True, "fast"), (2, False, "fast")])
def test_faithful_layers_with_act_quant_match_the_unsharded_layers(n, split_tokens, numerics):
    """Sums in another order move values by ulps, and now and then one across an e4m3 rounding threshold
    (12% of that value) or a routing decision: random models in faithful numerics are chaotic
    (docs/numerics.md#tolerances). So each layer is fed the reference's streams and compared per row:
    nearly every row to 1e-5, none by more than 1e-2. Fast numerics also round wo_a's input per group row, which
    2 GPUs hold whole (4 would split tiny-a's groups, which is refused below)."""
    cfg, whole, sharded = aligned_model(n, numerics)
    sharded.split_tokens = split_tokens
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, 160)
    streams = []
    whole.forward(whole.new_state(), ids, streams)
    for i in range(cfg.num_layers):
        want = whole.layer(i, streams[i], whole.new_state(), ids)
        got = sharded.layer(i, streams[i], sharded.new_state(), ids)
        err = rel_rows(got.reshape(len(ids), -1), want.reshape(len(ids), -1))
        assert np.median(err) < 1e-5 and np.mean(err > 1e-5) < 0.05 and err.max() < 1e-2, (i, err.max())


def test_misaligned_act_quant_blocks_and_indivisible_counts_are_refused():
    cfg, W, _ = fixture("tiny-a")
    quantized = frozenset(k for k in W if released_format(k) == "fp8")
    with pytest.raises(LayoutError, match="faithful numerics quantise wo_b's input in blocks of 128: each of 2 GPUs "
                                          "would hold 32 of its columns, not a whole number of blocks"):
        ShardedReference(cfg, W, 2, Numerics.named("faithful"), quantized)
    with pytest.raises(LayoutError, match="fast numerics quantise wo_a's input in blocks of 128 per group: each of "
                                          "the 2 GPUs sharing a group would hold 32 of its columns"):
        aligned_model(4, "fast")
    with pytest.raises(LayoutError, match="cannot split 4 attention heads over 8 GPUs"):
        ShardedReference(cfg, W, 8)
