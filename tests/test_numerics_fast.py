"""The fast numerics on the CPU (docs/numerics.md#modes): the reference's fast mode is faithful plus act_quant of
wo_a's input where wo_a is stored in fp8, and nothing else; where its distance from faithful is measured
(bench/numerics_fast.py); which entry points take it. The GPU build against it: test_gpu_fast.py."""
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY_A, rel_rows
from dsv4rt.config import from_dict
from dsv4rt.kv.plan import build_plan, default_numerics as plan_default
from dsv4rt.reference import Numerics, default_numerics, load_model
from dsv4rt.reference.quant import act_quant
from dsv4rt.tiny import make_tiny
from test_gpu_faithful import released, tiny_a_stored

ROOT = Path(__file__).resolve().parents[1]
T = 200


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    """`make-tiny --preset tiny --format official`: fp8 attention GEMMs (wo_a among them), fp4 experts."""
    return make_tiny(tmp_path_factory.mktemp("fast") / "official", "tiny", 3, fmt="official")


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(0).integers(2, 120000, T)


def test_fast_is_faithful_plus_the_wo_a_rounding():
    assert Numerics.named("fast") == dataclasses.replace(Numerics.named("faithful"), wo_a_quant=True)
    with pytest.raises(ValueError, match=r"unknown numerics 'fastest' \(expected exact, faithful or fast\)"):
        Numerics.named("fastest")


@pytest.mark.parametrize("fmt", [lambda n: None, lambda n: None if n.endswith(".attn.wo_a.weight") else released(n)],
                         ids=["unquantised", "all but wo_a"])
def test_fast_is_faithful_where_wo_a_is_not_fp8(tmp_path, fmt):
    """tiny-a as stored (float32) and with every other released weight quantised: the same logits bit for bit."""
    tiny_a_stored(tmp_path / "m", fmt).close()
    ids = np.load(TINY_A / "golden.npz")["input_ids"]
    fast, faithful = (load_model(tmp_path / "m", x).logits_chunked(ids) for x in ("fast", "faithful"))
    assert np.array_equal(fast, faithful)


def test_fast_differs_from_faithful_in_wo_a_input_alone(official, ids):
    """Faithful with act_quant put in front of every wo_a (each group's row) computes fast's logits bit for bit."""
    fast, faithful = load_model(official, "fast"), load_model(official, "faithful")
    for layer in faithful.layers:
        layer.attn.round_o = act_quant
    want = fast.logits_chunked(ids)
    assert np.array_equal(faithful.logits_chunked(ids), want)
    assert not np.array_equal(load_model(official, "faithful").logits_chunked(ids), want)


def test_distance_of_fast_from_faithful(official, ids):
    """The extra rounding is on and bounded: layer by layer (fed faithful's input streams) the median error lies
    between 1e-3 and e4m3's largest relative step, 2^-4 (bench/numerics_fast.py: at most 2.9-3.2e-2 on the tiny
    models, exact 3.5-3.8e-2); end to end most argmaxes agree (80-91% at 300 tokens)."""
    models = {x: load_model(official, x) for x in ("faithful", "fast", "exact")}
    streams = []
    base = models["faithful"].forward(models["faithful"].new_state(), ids, streams)
    for i in range(models["faithful"].cfg.num_layers):
        out = {x: m.layer(i, streams[i], m.new_state(), ids).reshape(T, -1) for x, m in models.items()}
        fast, exact = (np.median(rel_rows(out[x], out["faithful"])) for x in ("fast", "exact"))
        print(f"layer {i}: fast {fast:.2e}, exact {exact:.2e} from faithful (median)")
        assert 1e-3 < fast < 2.0 ** -4, i
    fast = models["fast"].forward(models["fast"].new_state(), ids)
    agree = np.mean(fast.argmax(-1) == base.argmax(-1))
    print(f"end to end: median {np.median(rel_rows(fast, base)):.2e}, argmax {agree:.3f}")
    assert np.isfinite(fast).all() and agree >= 0.7


def test_fast_is_never_a_default(official):
    cfg = from_dict(json.loads((official / "config.json").read_text()))
    assert default_numerics(cfg) == plan_default(cfg) == "faithful"
    assert load_model(official).numerics == Numerics.named("faithful")


def test_fast_plans_the_caches_of_faithful(official):
    cfg = from_dict(json.loads((official / "config.json").read_text()))
    fast, faithful = build_plan(cfg, "fast"), build_plan(cfg, "faithful")
    assert fast.numerics == "fast" and fast.kinds == faithful.kinds and fast.bytes_per_token == faithful.bytes_per_token
    with pytest.raises(ValueError, match="numerics must be one of exact, faithful, fast, got 'fastest'"):
        build_plan(cfg, "fastest")


def test_the_cpu_engine_takes_fast():
    from dsv4rt.engine import Engine
    from dsv4rt.reference.sampling import SamplingParams
    engine = Engine(TINY_A, numerics="fast")
    assert engine.model.numerics == Numerics.named("fast")
    assert len(engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_new_tokens=3))[0].token_ids) == 3
    with pytest.raises(ValueError, match="unknown numerics 'fastest'"):
        Engine(TINY_A, numerics="fastest")


def test_bench_script_prints_and_writes_its_figures(tmp_path):
    out = tmp_path / "fast.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "numerics_fast.py"), "--tokens", "40", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and len(result["rows"]) == 6
    assert {(row["model"], row["numerics"]) for row in result["rows"]} == \
        {(m, x) for m in ("official", "mid", "conditioned") for x in ("fast", "exact")}
    assert "layer median rel" in r.stdout
