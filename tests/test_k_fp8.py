"""cuda_src/fp8.cu against the numpy reference (docs/numerics.md#act-quant): act_quant byte for byte against
reference.quant.act_quant, the fp8 decode GEMM against reference.ops.Linear on the dequantised weight with
act_quant on its input (the faithful fp8 linear layer), at Flash and odd sizes; the W8A16 form (wo_a: fp8 weight,
unquantised input, grouped) and the fast numerics' grouped fp8 x fp8 form against numpy on the dequantised weight,
and the weight expansion bit for bit."""
import functools

import ml_dtypes
import numpy as np
import pytest

from conftest import rel_rows
from dsv4rt.loader.formats import dequant_fp8, quant_fp8
from dsv4rt.reference import quant
from dsv4rt.reference.ops import Linear

pytestmark = pytest.mark.gpu
BF16 = ml_dtypes.bfloat16
CANONICAL_NAN = 0x7F  # what the e4m3 conversion writes for NaN, whatever its sign


def act_quant_bytes(x: np.ndarray):
    """reference.quant.act_quant spelled as the bytes it stands for, from the same pow2_scale and round_e4m3:
    (e4m3 codes [m, k], e8m0 scale bytes [m, ceil(k/128)], the dequantised values)."""
    x = np.asarray(x, np.float32)
    m, k = x.shape
    nkb = -(-k // 128)
    padded = np.zeros((m, nkb * 128), np.float32)
    padded[:, :k] = x  # zeros leave a short block's amax (and its NaN) as they are
    blocks = padded.reshape(m, nkb, 128)
    with np.errstate(invalid="ignore", over="ignore"):
        s = quant.pow2_scale(np.maximum(np.abs(blocks).max(axis=-1, keepdims=True), np.float32(1e-4)),
                             quant.E4M3_MAX)
        q = quant.round_e4m3(blocks / s)
        values = (q * s).reshape(m, -1)[:, :k]
    q = q.reshape(m, -1)[:, :k]
    codes = np.where(np.isnan(q), CANONICAL_NAN, q.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)).astype(np.uint8)
    return codes, (np.frexp(s[..., 0])[1] + 126).astype(np.uint8), values


def awkward_rows(rng, m: int, k: int) -> np.ndarray:
    """Random rows, one magnitude per 128-block from 1e-30 to 1e30 (amax below 1e-4 takes the floor), and
    rows of edge cases cycling through: zeros, signed zeros, subnormals, huge values up to float32 max, a NaN,
    ±inf, and block maxima on, just above and just below the scale thresholds 448·2^e."""
    nkb = -(-k // 128)
    mag = np.repeat(10.0 ** rng.uniform(-30, 30, (m, nkb)), 128, axis=1)[:, :k]
    x = (rng.standard_normal((m, k)) * mag).astype(np.float32)
    for r in range(m):
        kind, row = r % 9, x[r]
        if kind == 0:
            row[:] = 0.0
        elif kind == 1:
            row[:] = -0.0
            row[rng.integers(k)] = 0.0
        elif kind == 2:
            row[:] = (rng.standard_normal(k) * 1e-41).astype(np.float32)
        elif kind == 3:
            row[:] = rng.uniform(-3.4e38, 3.4e38, k).astype(np.float32)
            row[rng.integers(k)] = np.finfo(np.float32).max
            row[rng.integers(k)] = np.float32(1e-3)
        elif kind == 4:
            row[rng.integers(k)] = np.nan
        elif kind == 5:
            row[rng.integers(k)] = np.inf
            row[rng.integers(k)] = -np.inf
            row[rng.integers(k)] = 1e6
        elif kind >= 6:
            for b in range(nkb):
                blk = row[128 * b:128 * (b + 1)]
                top = np.float32(448.0 * 2.0 ** int(rng.integers(-40, 40)))
                blk[:] = rng.uniform(-1, 1, blk.size).astype(np.float32) * top
                edge = {6: top, 7: np.nextafter(top, np.float32(np.inf)), 8: np.nextafter(top, np.float32(0))}[kind]
                blk[rng.integers(blk.size)] = edge * rng.choice([-1, 1])
    return x


def fetch(rt, buf, shape, dtype) -> np.ndarray:
    rt.stream.synchronize()
    return buf.copy_to_host(np.empty(shape, dtype))


def run_act_quant(rt, dev, x, dtype, offset: int = 0):
    """q and scale bytes from the GPU; offset (elements) shifts x off its 16-byte alignment."""
    from dsv4rt.model import fp8
    m, k = x.shape
    host = np.concatenate([np.zeros(offset, dtype), x.astype(dtype).reshape(-1)])
    dx = dev(host)
    dq, ds = dev(np.full((m, k), 0xAB, np.uint8)), dev(np.full((m, fp8.scale_columns(k)), 0xAB, np.uint8))
    fp8.act_quant(rt.device, dtype, dq.ptr, ds.ptr, dx.ptr + offset * np.dtype(dtype).itemsize, m, k)(rt.stream)
    return fetch(rt, dq, (m, k), np.uint8), fetch(rt, ds, (m, fp8.scale_columns(k)), np.uint8)


def check_against_reference(x, q, s):
    codes, scales, values = act_quant_bytes(x)
    # the twin is the reference itself: same values, zeros of the same sign, NaN in the same places
    with np.errstate(over="ignore"):  # float32 max rounds up to 256·2^120 = inf in the dequantised values
        ref = quant.act_quant(x)
    assert np.array_equal(values, ref, equal_nan=True) and np.array_equal(np.signbit(values), np.signbit(ref))
    assert np.array_equal(s, scales)
    q = np.where((q & 0x7F) == 0x7F, CANONICAL_NAN, q)
    bad = np.argwhere(q != codes)
    assert bad.size == 0, f"{len(bad)} codes differ, first at {bad[0]}: x={x[tuple(bad[0])]!r} " \
                          f"gpu=0x{q[tuple(bad[0])]:02x} ref=0x{codes[tuple(bad[0])]:02x}"


@pytest.mark.parametrize("dtype", [np.float32, BF16])
@pytest.mark.parametrize("m, k", [(18, 4096), (9, 1024), (27, 1000), (9, 48), (9, 7), (10, 130), (9, 257),
                                  (3, 8192), (1, 1), (64, 512)])
def test_act_quant_bytes_equal_the_reference(rt, dev, dtype, m, k):
    x = awkward_rows(np.random.default_rng(m * 7919 + k), m, k).astype(dtype).astype(np.float32)
    q, s = run_act_quant(rt, dev, x, dtype)
    check_against_reference(x, q, s)


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_act_quant_misaligned_input_takes_the_scalar_path(rt, dev, dtype):
    x = awkward_rows(np.random.default_rng(5), 18, 512).astype(dtype).astype(np.float32)
    q, s = run_act_quant(rt, dev, x, dtype, offset=1)
    check_against_reference(x, q, s)


def test_act_quant_every_e4m3_code(rt, dev):
    """Each finite e4m3 value (and the ties between neighbours) times a power of two, in blocks whose
    amax is 448·2^e exactly: the quotient is the code itself (or a tie to break to even)."""
    grid = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    grid = np.unique(grid[np.isfinite(grid)])
    pos = grid[grid > 0]
    ties = ((pos[:-1].astype(np.float64) + pos[1:]) / 2).astype(np.float32)
    vals = np.concatenate([grid, ties, -ties])
    rows = []
    for e in (-20, -3, 0, 7, 60):
        for at in range(0, len(vals), 127):
            row = np.zeros(128, np.float32)
            row[:len(vals[at:at + 127])] = vals[at:at + 127]
            row[127] = 448.0
            rows.append(row * np.float32(2.0 ** e))
    x = np.stack(rows)
    q, s = run_act_quant(rt, dev, x, np.float32)
    check_against_reference(x, q, s)


@functools.cache
def fp8_weight(n: int, k: int):
    """A checkpoint-like weight: quant_fp8 of random rows whose magnitudes spread over four decades, as
    (e4m3 bytes, e8m0 bytes, the reference Linear on the dequantised float32 weight with act_quant)."""
    rng = np.random.default_rng(n * 31 + k)
    w = rng.standard_normal((n, k), dtype=np.float32) * (10.0 ** rng.uniform(-3, 1, (n, 1)) / np.sqrt(k)).astype(
        np.float32)
    q, s = quant_fp8(w)
    return q.view(np.uint8), s.view(np.uint8), Linear(dequant_fp8(q, s), quant.act_quant)


def activations(m: int, k: int) -> np.ndarray:
    rng = np.random.default_rng(m * 131 + k)
    return (rng.standard_normal((m, k)) * 10.0 ** rng.uniform(-2, 2, (m, 1))).astype(np.float32)


def run_gemm(rt, dev, out_dtype, xq, xs, wq, ws, m, n, k):
    from dsv4rt.model import fp8
    dy = dev(np.full((m, n), np.nan, out_dtype))
    fp8.skinny_gemm(rt.device, out_dtype, dy.ptr, dev(xq).ptr, dev(xs).ptr, dev(wq).ptr, dev(ws).ptr, m, n, k)(
        rt.stream)
    return fetch(rt, dy, (m, n), out_dtype).astype(np.float32)


FLASH = [(1024, 4096), (32768, 1024), (512, 4096), (4096, 1024), (4096, 8192)]  # wq_a, wq_b, wkv, [n, k]; wo_b
ODD = [(100, 48), (1000, 320), (136, 272), (1, 16), (257, 1040), (24, 4112), (3000, 64)]


@pytest.mark.parametrize("out_dtype", [np.float32, BF16])
@pytest.mark.parametrize("n, k", FLASH + ODD)
@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_skinny_gemm_matches_the_faithful_linear(rt, dev, out_dtype, m, n, k):
    wq, ws, linear = fp8_weight(n, k)
    x = activations(m, k)
    xq, xs, _ = act_quant_bytes(x)
    y = run_gemm(rt, dev, out_dtype, xq, xs, wq, ws, m, n, k)
    assert rel_rows(y, linear(x)).max() < 1e-2


@pytest.mark.parametrize("m", [9, 17, 40])
def test_skinny_gemm_rows_past_one_tile(rt, dev, m):
    n, k = 1000, 320
    wq, ws, linear = fp8_weight(n, k)
    x = activations(m, k)
    xq, xs, _ = act_quant_bytes(x)
    assert rel_rows(run_gemm(rt, dev, np.float32, xq, xs, wq, ws, m, n, k), linear(x)).max() < 1e-2


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_act_quant_then_gemm_in_a_replayed_graph(rt, dev, dtype):
    """The decode pair as a CUDA graph holds it: quantise the activations, then the GEMM, replayed on new inputs."""
    from dsv4rt.cuda.device import Graph
    from dsv4rt.model import fp8
    m, n, k = 4, 4096, 1024
    wq, ws, linear = fp8_weight(n, k)
    dx, dq = dev(np.zeros((m, k), dtype)), dev(np.zeros((m, k), np.uint8))
    ds, dy = dev(np.zeros((m, fp8.scale_columns(k)), np.uint8)), dev(np.full((m, n), np.nan, np.float32))
    launches = [fp8.act_quant(rt.device, dtype, dq.ptr, ds.ptr, dx.ptr, m, k),
                fp8.skinny_gemm(rt.device, np.float32, dy.ptr, dq.ptr, ds.ptr, dev(wq).ptr, dev(ws).ptr, m, n, k)]
    graph = Graph(rt.stream)
    with graph:
        for launch in launches:
            launch(rt.stream)
    for trial in range(2):
        x = activations(m + trial, k)[:m].astype(dtype).astype(np.float32)
        dx.copy_from_host(x.astype(dtype), rt.stream)  # a pageable copy may return before its DMA lands
        graph.replay()
        assert rel_rows(fetch(rt, dy, (m, n), np.float32), linear(x)).max() < 1e-2
    graph.close()


def grouped_reference(x: np.ndarray, w: np.ndarray, groups: int) -> np.ndarray:
    """y[:, j·n..] = x[:, j·k..] · w[j·n..]ᵀ in float64, as reference.attention applies wo_a."""
    xs = np.split(x.astype(np.float64), groups, axis=1)
    ws = np.split(w.astype(np.float64), groups, axis=0)
    return np.concatenate([a @ b.T for a, b in zip(xs, ws)], axis=1)


WO_A = [(8, 1024, 4096), (2, 32, 64), (3, 48, 80), (1, 1000, 320)]  # groups, columns a group, k: Flash, tiny-a, odd


@pytest.mark.parametrize("dtype, tol", [(np.float32, 1e-5), (BF16, 1e-2)])
@pytest.mark.parametrize("groups, n, k", WO_A)
@pytest.mark.parametrize("m", [1, 5, 16, 17])
def test_w8a16_grouped_gemm(rt, dev, dtype, tol, groups, n, k, m):
    """The float32 build splits its inputs into three bf16 parts, so it keeps float32's precision; bf16 inputs
    times e4m3 weights are exact products, rounded once to the bf16 output."""
    from dsv4rt.model import fp8
    wq, ws, _ = fp8_weight(groups * n, k)
    x = activations(m, groups * k).astype(dtype)
    dy = dev(np.full((m, groups * n), np.nan, dtype))
    fp8.skinny_gemm(rt.device, dtype, dy.ptr, dev(x).ptr, 0, dev(wq).ptr, dev(ws).ptr, m, groups * n, k,
                    in_dtype=dtype, group_n=n)(rt.stream)
    want = grouped_reference(x.astype(np.float32), dequant_fp8(wq.view(ml_dtypes.float8_e4m3fn), ws), groups)
    assert rel_rows(fetch(rt, dy, (m, groups * n), dtype), want).max() < tol



@pytest.mark.parametrize("dtype, tol", [(np.float32, 1e-5), (BF16, 1e-2)])
@pytest.mark.parametrize("groups, n, k", WO_A + [(2, 128, 128)])   # and tests/test_gpu_faithful.py's "mid"
@pytest.mark.parametrize("m", [1, 16, 17, 300])
def test_fast_output_projection(rt, dev, dtype, tol, groups, n, k, m):
    """The fast numerics' wo_a (linear_fp8 with group_n): x quantised per group row, as reference.attention's
    round_o, then the grouped fp8 x fp8 GEMM (bf16 prefill batches of 128-multiple widths: the wgmma kernel)."""
    from dsv4rt.model import fp8
    from dsv4rt.model.linear_fp8 import linear_fp8
    wq, ws, _ = fp8_weight(groups * n, k)
    x = activations(m, groups * k).astype(dtype)
    dq, ds = dev(np.zeros((m * groups, k), np.uint8)), dev(np.zeros((m * groups, fp8.scale_columns(k)), np.uint8))
    dy = dev(np.full((m, groups * n), np.nan, dtype))
    linear_fp8(rt.device, dtype, dev(x).ptr, dev(wq).ptr, dev(ws).ptr, dy.ptr, m, groups * n, k, xq=dq.ptr, xs=ds.ptr,
               group_n=n)(rt.stream)
    rounded = quant.act_quant(x.astype(np.float32).reshape(m, groups, k)).reshape(m, groups * k)
    want = grouped_reference(rounded, dequant_fp8(wq.view(ml_dtypes.float8_e4m3fn), ws), groups)
    assert rel_rows(fetch(rt, dy, (m, groups * n), dtype).astype(np.float32), want).max() < tol

def test_w8a16_gemm_passes_inf_and_nan_where_numpy_does(rt, dev):
    from dsv4rt.model import fp8
    m, n, k = 4, 256, 256
    wq, ws, _ = fp8_weight(n, k)
    x = activations(m, k)
    x[1, 7], x[2, 100] = np.inf, np.nan
    dy = dev(np.zeros((m, n), np.float32))
    fp8.skinny_gemm(rt.device, np.float32, dy.ptr, dev(x).ptr, 0, dev(wq).ptr, dev(ws).ptr, m, n, k,
                    in_dtype=np.float32)(rt.stream)
    with np.errstate(invalid="ignore", over="ignore"):
        want = grouped_reference(x, dequant_fp8(wq.view(ml_dtypes.float8_e4m3fn), ws), 1)
    got = fetch(rt, dy, (m, n), np.float32)
    assert not np.isfinite(want[1:3]).any() and np.array_equal(np.isnan(got), np.isnan(want))
    assert rel_rows(got[[0, 3]], want[[0, 3]]).max() < 1e-5


@pytest.mark.parametrize("dtype", [np.float32, BF16])
@pytest.mark.parametrize("n, k", [(8192, 4096), (100, 48), (257, 1040)])
def test_dequantize_is_exact(rt, dev, dtype, n, k):
    from dsv4rt.model import fp8
    wq, ws, _ = fp8_weight(n, k)
    out = dev(np.full((n, k), np.nan, dtype))
    fp8.dequantize(rt.device, dtype, out.ptr, dev(wq).ptr, dev(ws).ptr, n, k)(rt.stream)
    want = dequant_fp8(wq.view(ml_dtypes.float8_e4m3fn), ws)
    assert fetch(rt, out, (n, k), dtype).tobytes() == want.astype(dtype).tobytes()


def test_w8a16_refuses_a_mixed_output_type():
    from dsv4rt.model import fp8
    with pytest.raises(ValueError, match="output has its input's dtype"):
        fp8.skinny_gemm(None, np.float32, 0, 0, 0, 0, 0, 1, 128, 256, in_dtype=BF16)


def test_skinny_gemm_refuses_k_off_16_bytes():
    from dsv4rt.model import fp8
    with pytest.raises(ValueError, match="multiple of 16"):
        fp8.skinny_gemm(None, np.float32, 0, 0, 0, 0, 0, 1, 128, 200)
