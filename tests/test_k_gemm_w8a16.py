"""cuda_src/gemm_w8a16.cu, the faithful wo_a of prefill batches (wgmma, sm_90a): against numpy on the dequantised
weight at the Flash shape and odd ones, every weight value bit for bit as fp8.dequantize gives it (scales from 2^-127
to 2^119, every finite e4m3 code) and NaN where numpy has it. Without a GPU: its launcher's refusals, its constants
against the source, its SASS, and that the forward and the memory plan agree on when it replaces the expanded wo_a."""
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from conftest import rel_rows, skip_without_wgmma
from dsv4rt.config import from_dict
from dsv4rt.loader.formats import dequant_fp8
from dsv4rt.presets import PRESETS
from test_k_fp8 import fetch
from test_k_gemm_fp8 import fp8_weight, kernel_sass, nvdisasm

gpu = pytest.mark.gpu
BF16 = ml_dtypes.bfloat16
FLASH_WO_A = (8, 1024, 4096)  # groups, columns a group, k
SAMPLED = 256                 # rows of large outputs checked against numpy, besides the first and last tiles


def run(rt, dev, x: np.ndarray, wq, ws, n: int, k: int, groups: int) -> np.ndarray:
    """y from the GPU; the rows up to the end of the last block's rows past m must keep their NaN."""
    from dsv4rt.model.gemm_w8a16 import ROWS, w8a16_gemm
    m = len(x)
    rows = -(-m // ROWS) * ROWS
    dy = dev(np.full((rows, groups * n), np.nan, BF16))
    w8a16_gemm(rt.device, dy.ptr, dev(x).ptr, dev(wq).ptr, dev(ws).ptr, m, n, k, groups)(rt.stream)
    y = fetch(rt, dy, (rows, groups * n), BF16)
    assert np.isnan(y[m:].astype(np.float32)).all(), "rows past m written"
    return y[:m]


def grouped(x: np.ndarray, w: np.ndarray, groups: int, rows) -> np.ndarray:
    """x[rows] times each group's weight rows, in float64."""
    xs = np.split(x[rows].astype(np.float64), groups, axis=1)
    return np.concatenate([a @ b.T for a, b in zip(xs, np.split(w.astype(np.float64), groups))], axis=1)


@gpu
@pytest.mark.parametrize("groups, n, k, m", [(*FLASH_WO_A, m) for m in (1, 200, 700, 8192)] +
                         [(3, 128, 384, 77), (2, 384, 256, 130),
                          (2, 1024, 256, 257),  # one row into a second 256-row block
                          (1, 128, 128, 300)])  # two k steps, fewer than the copies issued ahead
def test_matches_numpy_on_the_dequantised_weight(rt, dev, groups, n, k, m):
    """bf16 activations times bf16 weights are exact products; fp32 sums; one bf16 rounding of the output."""
    skip_without_wgmma(rt)
    wq, ws, _ = fp8_weight(groups * n, k)
    w = dequant_fp8(wq.view(ml_dtypes.float8_e4m3fn), ws).astype(BF16)
    rng = np.random.default_rng(m + k)
    magnitude = (10.0 ** rng.uniform(-2, 2, (m, 1))).astype(np.float32)
    x = (rng.standard_normal((m, groups * k), dtype=np.float32) * magnitude).astype(BF16)
    y = run(rt, dev, x, wq, ws, n, k, groups)
    rows = np.unique(np.r_[0:min(m, 128), rng.integers(0, m, SAMPLED), max(0, m - 128):m]) if m > 1024 else slice(None)
    assert rel_rows(y[rows], grouped(x, w, groups, rows)).max() < 2.0 ** -8


@gpu
def test_every_weight_value_is_the_dequantised_one(rt, dev):
    """One-hot rows read the weight back: y[r, g·n + c] = w[g·n + c, r] · 2^p exactly, where the row's power of two
    brings each column block's scales into the normal range (block 0: scale bytes 0..40, the bf16 rounding of
    subnormal products; block 1: 100..150 with 134 and 135, the last byte whose scale the kernel folds into one
    multiply and the first it does not; block 2: 200..246, the largest that keep 448·s finite)."""
    skip_without_wgmma(rt)
    groups, n, k = 2, 256, 384
    rng = np.random.default_rng(7)
    finite = np.setdiff1d(np.arange(256), [0x7F, 0xFF]).astype(np.uint8)
    wq = rng.choice(finite, (groups * n, k))
    ws = np.stack([rng.integers(lo, hi + 1, groups * n // 128) for lo, hi in ((0, 40), (100, 150), (200, 246))],
                  axis=1).astype(np.uint8)
    ws[:2, 1] = 134, 135
    power = np.repeat([2.0 ** 100, 1.0, 2.0 ** -100], 128)
    x = np.zeros((k, groups, k))
    x[np.arange(k), :, np.arange(k)] = power[:, None]
    y = run(rt, dev, x.reshape(k, groups * k).astype(BF16), wq, ws, n, k, groups)
    w = dequant_fp8(wq.view(ml_dtypes.float8_e4m3fn), ws).astype(BF16).astype(np.float64)
    assert np.array_equal(y.astype(np.float64), w.T * power[:, None])


@gpu
def test_nan_codes_and_scales_give_nan_where_numpy_does(rt, dev):
    """A NaN weight code (which the bit-moving widening alone would read as ±480) or a NaN block scale makes its
    output columns NaN in every row; the rest stays within rounding."""
    skip_without_wgmma(rt)
    groups, n, k, m = 2, 256, 256, 40
    wq, ws, _ = fp8_weight(groups * n, k)
    wq, ws = wq.copy(), ws.copy()
    wq[[3, 300, 301], [5, 130, 255]] = [0x7F, 0xFF, 0x7F]
    ws[1, 1] = 0xFF  # rows 128..255, columns 128..255
    w = dequant_fp8(wq.view(ml_dtypes.float8_e4m3fn), ws).astype(BF16).astype(np.float64)
    x = np.random.default_rng(3).standard_normal((m, groups * k)).astype(BF16)
    y = run(rt, dev, x, wq, ws, n, k, groups).astype(np.float64)
    nan_columns = np.isnan(w).any(axis=1)
    assert nan_columns.sum() == 3 + 128 and np.array_equal(np.isnan(y), np.broadcast_to(nan_columns, y.shape))
    assert rel_rows(y[:, ~nan_columns], grouped(x, np.nan_to_num(w), groups, slice(None))[:, ~nan_columns]).max() \
        < 2.0 ** -8


@pytest.mark.parametrize("n, k, groups", [(200, 128, 1), (128, 200, 1), (128, 64, 2), (0, 128, 1), (128, 128, 0)])
def test_refuses_shapes_off_128(n, k, groups):
    from dsv4rt.model.gemm_w8a16 import w8a16_gemm
    with pytest.raises(ValueError, match="positive multiples of 128"):
        w8a16_gemm(None, 0, 0, 0, 0, 1, n, k, groups)


def test_refuses_misaligned_operands():
    from dsv4rt.model.gemm_w8a16 import w8a16_gemm
    with pytest.raises(ValueError, match="16-byte aligned"):
        w8a16_gemm(None, 0, 8, 0, 0, 1, 128, 128, 1)


def test_refuses_other_archs_and_launches_nothing_for_no_rows():
    from dsv4rt.model.gemm_w8a16 import w8a16_gemm
    from dsv4rt.model.paged import NOTHING
    with pytest.raises(RuntimeError, match="runs on sm_90a .* this device is sm_80"):
        w8a16_gemm(SimpleNamespace(arch="sm_80"), 0, 0, 0, 0, 300, 1024, 4096, 8)
    assert w8a16_gemm(SimpleNamespace(arch="sm_80"), 0, 0, 0, 0, 0, 1024, 4096, 8) is NOTHING


def test_constants_equal_the_cuda_source():
    from dsv4rt.model import gemm_w8a16
    from test_kernel_facts import constants, launch_bounds
    c = constants("gemm_w8a16.cu")
    assert (gemm_w8a16.ROWS, gemm_w8a16.COLS, gemm_w8a16.K_STEP, gemm_w8a16.STAGES, gemm_w8a16.THREADS) == (
        c["kW8Rows"], c["kW8Cols"], c["kW8K"], c["kW8Stages"], c["kW8Threads"])
    assert gemm_w8a16.THREADS == launch_bounds("gemm_w8a16.cu", "w8a16_gemm")[0]
    assert gemm_w8a16.SHARED == c["kW8Stages"] * (c["kW8XBytes"] + c["kW8RawBytes"]) + 1024 <= 227 * 1024


@pytest.mark.skipif(nvdisasm() is None, reason="no nvdisasm on PATH or in the nvidia wheels")
def test_kernel_runs_on_gmma(tmp_path, monkeypatch):
    """Built as dsv4rt builds it for sm_90a, the kernel multiplies with HGMMA (wgmma on bf16), asynchronously, its
    weight operand from registers, and keeps every value in registers (no local memory)."""
    import re
    _, sass = kernel_sass(tmp_path, monkeypatch, "gemm_w8a16")
    assert len(re.findall(r"\bHGMMA\.64x256x16\.F32\.BF16 R\d+, R\d+, gdesc", sass)) == 4
    assert not re.search(r"\b(LDL|STL)\b", sass)


FLASH_SLICE = from_dict(PRESETS["flash-slice"])


def projection_path(arch: str, dtype, rows: int, monkeypatch) -> str:
    """Which kernel GpuModel._output_projection takes for flash-slice's fp8 wo_a in faithful numerics."""
    from dsv4rt.model import forward
    monkeypatch.setattr(forward, "w8a16_gemm", lambda *a: "w8a16")
    monkeypatch.setattr(forward.fp8, "skinny_gemm", lambda *a, **kw: "skinny")
    monkeypatch.setattr(forward.fp8, "dequantize", lambda *a: "expand")
    monkeypatch.setattr(forward, "grouped_linear", lambda *a: "cublas")
    weight = SimpleNamespace(ptr=0)
    model = SimpleNamespace(cfg=FLASH_SLICE, ws={"o": 0, "t": 0, "wo_a": 0}, dtype=np.dtype(dtype), fast=False,
                            w={"wo_a.weight": weight, "wo_a.scale": weight}, blas=None,
                            rt=SimpleNamespace(device=SimpleNamespace(arch=arch)))
    launch = forward.GpuModel._output_projection(model, "wo_a.weight", rows)
    return launch if isinstance(launch, str) else "+".join(launch.launches)


@pytest.mark.parametrize("arch, dtype, rows, path", [
    ("sm_90a", BF16, 8192, "w8a16"), ("sm_90a", BF16, 17, "w8a16"), ("sm_90a", BF16, 16, "skinny"),
    ("sm_80", BF16, 8192, "expand+cublas"), ("sm_90a", np.float32, 8192, "expand+cublas")])
def test_forward_and_memory_plan_agree_on_the_expanded_wo_a(monkeypatch, arch, dtype, rows, path):
    from dsv4rt.model.memory import workspace_sizes
    assert projection_path(arch, dtype, rows, monkeypatch) == path
    sizes = workspace_sizes(FLASH_SLICE, dtype, rows=rows, out_rows=rows, max_len=rows, sm_count=132,
                            numerics="faithful", fp8_wo_a=True, arch=arch)
    assert ("wo_a" in sizes) == (path == "expand+cublas")
