"""The numpy reference against the golden files (transformers float32 and the official code)."""
from functools import lru_cache

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import REAL_RATIOS, TINY_A, rel_rows
from dsv4rt.loader import Checkpoint, quant_fp8, scale_name, to_hf, to_official
from dsv4rt.reference import Model, Numerics, checkpoint_weights, load_model

FIXTURES = {"tiny-a": TINY_A, "real-ratios": REAL_RATIOS}


@lru_cache(maxsize=None)
def model(name: str, numerics: str = "exact"):
    return load_model(FIXTURES[name], numerics)


@lru_cache(maxsize=None)
def golden(name: str, file: str = "golden.npz"):
    return dict(np.load(FIXTURES[name] / file))


def incremental(m, ids, split):
    st = m.new_state()
    out = [m.forward(st, ids[:split])[-1]]
    out += [m.forward(st, ids[t:t + 1])[0] for t in range(split, len(ids))]
    return np.stack(out)


@pytest.mark.parametrize("name", FIXTURES)
def test_one_prefill_matches_golden(name):
    g, m = golden(name), model(name)
    streams = []
    logits = m.forward(m.new_state(), g["input_ids"], streams)
    assert rel_rows(logits, g["logits_full"]).max() < 1e-5
    T = len(g["input_ids"])
    for layer, (ours, ref) in enumerate(zip(streams, g["hidden_streams"])):
        assert rel_rows(ours.reshape(T, -1), ref.reshape(T, -1)).max() < 1e-5, f"layer {layer}"
    assert len(streams) == len(g["hidden_streams"]) + 1


@pytest.mark.parametrize("name", FIXTURES)
def test_final_hidden_matches_golden(name):
    g, m = golden(name), model(name)
    st = m.new_state()
    X = m.embed_streams(g["input_ids"])
    for i in range(m.cfg.num_layers):
        X = m.layer(i, X, st, g["input_ids"])
    assert rel_rows(m.final_hidden(X), g["final_hidden"]).max() < 1e-5


@pytest.mark.parametrize("name", FIXTURES)
def test_chunked_prefill_matches_golden(name):
    g = golden(name)
    logits = model(name).logits_chunked(g["input_ids"], g["chunks"])
    assert rel_rows(logits, g["logits_chunked"]).max() < 1e-5


@pytest.mark.parametrize("name", FIXTURES)
def test_token_by_token_matches_golden(name):
    g = golden(name)
    logits = incremental(model(name), g["input_ids"], int(g["split"]))
    assert rel_rows(logits, g["logits_incr"]).max() < 1e-5


def test_real_ratios_fixture_exercises_every_layer_kind():
    cfg = model("real-ratios").cfg
    assert set(cfg.ratios) == {0, 4, 128} and cfg.window == 128 and cfg.yarn is not None
    assert len(golden("real-ratios")["input_ids"]) >= 600
    assert any(c % 4 for c in golden("real-ratios")["chunks"][:-1])


def test_any_chunking_gives_the_same_logits():
    g, m = golden("real-ratios"), model("real-ratios")
    ids = g["input_ids"][:300]
    for chunks in ([300], [1] * 3 + [297], [127, 1, 2, 170], [4, 124, 129, 43]):
        assert rel_rows(m.logits_chunked(ids, chunks), g["logits_full"][:300]).max() < 1e-5


@pytest.mark.parametrize("name", FIXTURES)
def test_official_and_transformers_layouts_give_identical_logits(name, tmp_path):
    src = FIXTURES[name]
    tensors = load_file(str(src / "model.safetensors"))
    hf_layout = any(k.startswith("model.") for k in tensors)
    renamed = {(to_official(k) if hf_layout else to_hf(k)): v for k, v in tensors.items()}
    assert renamed.keys() != tensors.keys()
    save_file(renamed, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_bytes((src / "config.json").read_bytes())
    ids = golden(name)["input_ids"][:200]
    a = model(name).logits_chunked(ids)
    b = load_model(tmp_path, "exact").logits_chunked(ids)
    assert np.array_equal(a, b)


def test_faithful_matches_official_code_one_prefill():
    f = golden("tiny-a", "faithful_fp32.npz")
    logits = model("tiny-a", "faithful").forward(model("tiny-a", "faithful").new_state(), f["input_ids"])
    assert rel_rows(logits, f["logits_full"]).max() < 1e-4


def test_faithful_matches_official_code_token_by_token():
    f = golden("tiny-a", "faithful_fp32.npz")
    logits = incremental(model("tiny-a", "faithful"), f["input_ids"], int(f["split"]))
    assert rel_rows(logits, f["logits_incr"]).max() < 1e-4


def test_faithful_is_chunking_invariant():
    g = golden("tiny-a")
    m = model("tiny-a", "faithful")
    full = m.logits_chunked(g["input_ids"])
    # fp8 rounding thresholds amplify ulp differences: docs/numerics.md#tolerances measures 2e-5 for the official code
    assert rel_rows(m.logits_chunked(g["input_ids"], g["chunks"]), full).max() < 5e-5


def test_faithful_differs_from_exact_by_the_quantisation():
    g = golden("tiny-a")
    exact = model("tiny-a").logits_chunked(g["input_ids"])
    faithful = model("tiny-a", "faithful").logits_chunked(g["input_ids"])
    assert np.median(rel_rows(faithful, exact)) > 1e-3


def _fp8_copy_of_tiny_a(tmp_path):
    """tiny-a with every GEMM weight stored as fp8 e4m3 + 128x128 e8m0 scales, as released."""
    tensors = {to_official(k): v for k, v in load_file(str(TINY_A / "model.safetensors")).items()}
    gemm = (".wq_a.weight", ".wq_b.weight", ".wkv.weight", ".wo_b.weight", ".w1.weight", ".w2.weight", ".w3.weight")
    out = {}
    for name, w in tensors.items():
        if name.endswith(gemm) and "compressor" not in name:
            out[name], out[scale_name(name)] = quant_fp8(w)
        else:
            out[name] = w
    save_file(out, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_bytes((TINY_A / "config.json").read_bytes())
    return tmp_path


def test_each_faithful_rounding_matters_and_all_off_equals_exact(tmp_path):
    path = _fp8_copy_of_tiny_a(tmp_path)
    ids = golden("tiny-a")["input_ids"][:120]
    exact = load_model(path, "exact")
    assert exact.numerics == Numerics()
    base = exact.logits_chunked(ids)
    with Checkpoint.open(path) as ck:
        quantized = frozenset(n for n in ck.names() if ck.is_quantized(n))
    assert len(quantized) > 10
    faithful = load_model(path, "faithful")
    assert rel_rows(faithful.logits_chunked(ids), base).max() > 1e-3
    weights = _weights_of(path)
    for switch in ("act_quant", "kv_fp8", "indexer_fp4"):
        one = Model(exact.cfg, weights, Numerics(**{switch: True}), quantized)
        assert rel_rows(one.logits_chunked(ids), base).max() > 1e-4, switch
    off = Model(exact.cfg, weights, Numerics(act_quant=False, kv_fp8=False, indexer_fp4=False), quantized)
    assert np.array_equal(off.logits_chunked(ids), base)


def _weights_of(path):
    with Checkpoint.open(path) as ck:
        return checkpoint_weights(ck)
