"""Dense GEMMs through cuBLAS against numpy in float64: Flash shapes, odd shapes, the grouped output
projection, graph capture."""
import ml_dtypes
import numpy as np
import pytest

from conftest import rel_rows

pytestmark = pytest.mark.gpu
BF16 = ml_dtypes.bfloat16


def upload(rt, host):
    buf = rt.arena.alloc(host.nbytes)
    buf.copy_from_host(host)
    return buf


def poisoned(rt, shape, dtype):
    return upload(rt, np.full(shape, np.nan, dtype))


def tolerance(dtype, out_dtype):
    if dtype == np.float32:
        return 1e-5
    # bf16 products are exact in fp32 and the sum is fp32: only a bf16 output adds a rounding (2^-9).
    return 1e-2 if out_dtype == BF16 else 1e-4


def random(rng, shape, scale=1.0):
    """Values on the bf16 grid, so a float32 and a bf16 build see the same numbers."""
    return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(BF16).astype(np.float32)


def run_linear(rt, blas, dtype, out_dtype, x, w):
    from dsv4rt.model.gemm import linear
    m, k = x.shape
    n = w.shape[0]
    dx, dw, dy = upload(rt, x.astype(dtype)), upload(rt, w.astype(dtype)), poisoned(rt, (m, n), out_dtype)
    linear(blas, dtype, dx.ptr, dw.ptr, dy.ptr, m, n, k, out_dtype)(rt.stream)
    rt.stream.synchronize()
    y = dy.copy_to_host(np.empty((m, n), out_dtype)).astype(np.float32)
    for b in (dx, dw, dy):
        b.free()
    return y


COMBOS = [(np.float32, np.float32), (BF16, BF16), (BF16, np.float32)]


@pytest.mark.parametrize("dtype, out_dtype", COMBOS)
@pytest.mark.parametrize("m, n, k", [(37, 1024, 4096), (64, 32768, 1024), (300, 4096, 1024), (5, 77, 24),
                                     (1, 3, 40), (130, 515, 1000)])
def test_linear_matches_numpy(rt, blas, dtype, out_dtype, m, n, k):
    rng = np.random.default_rng(m * n + k)
    x, w = random(rng, (m, k)), random(rng, (n, k), k ** -0.5)
    y = run_linear(rt, blas, dtype, out_dtype, x, w)
    assert rel_rows(y, x.astype(np.float64) @ w.T.astype(np.float64)).max() < tolerance(dtype, out_dtype)


@pytest.fixture(scope="module")
def lm_head():
    """Rows are windows 61 elements apart in one pool: distinct rows, a fraction of the random numbers."""
    pool = random(np.random.default_rng(129280), (129279 * 61 + 4096,), 4096 ** -0.5)
    w = np.lib.stride_tricks.as_strided(pool, (129280, 4096), (61 * 4, 4), writeable=False)
    return w, w.astype(np.float64)


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_lm_head_logits_are_fp32(rt, blas, lm_head, dtype):
    from dsv4rt.model.gemm import linear
    w, w64 = lm_head
    dw = upload(rt, w.astype(dtype))
    for m in (1, 64):
        x = random(np.random.default_rng(m), (m, 4096))
        dx, dy = upload(rt, x.astype(dtype)), poisoned(rt, (m, 129280), np.float32)
        linear(blas, dtype, dx.ptr, dw.ptr, dy.ptr, m, 129280, 4096, np.float32)(rt.stream)
        rt.stream.synchronize()
        y = dy.copy_to_host(np.empty((m, 129280), np.float32))
        ref = x.astype(np.float64) @ w64.T
        assert rel_rows(y, ref).max() < tolerance(dtype, np.float32)
        dx.free()
        dy.free()
    dw.free()


@pytest.mark.parametrize("dtype, out_dtype", COMBOS)
@pytest.mark.parametrize("m, groups, n, k", [(37, 8, 1024, 4096), (1, 8, 1024, 4096), (3, 3, 24, 40)])
def test_grouped_output_projection(rt, blas, dtype, out_dtype, m, groups, n, k):
    from dsv4rt.model.gemm import grouped_linear
    rng = np.random.default_rng(m + groups * n + k)
    o, w = random(rng, (m, groups, k)), random(rng, (groups, n, k), k ** -0.5)
    do, dw, dt = upload(rt, o.astype(dtype)), upload(rt, w.astype(dtype)), poisoned(rt, (m, groups, n), out_dtype)
    grouped_linear(blas, dtype, do.ptr, dw.ptr, dt.ptr, m, groups, n, k, out_dtype)(rt.stream)
    rt.stream.synchronize()
    t = dt.copy_to_host(np.empty((m, groups, n), out_dtype)).astype(np.float32)
    ref = np.einsum("mgk,gnk->mgn", o.astype(np.float64), w.astype(np.float64))
    assert rel_rows(t.reshape(m, -1), ref.reshape(m, -1)).max() < tolerance(dtype, out_dtype)
    for b in (do, dw, dt):
        b.free()


def test_graph_replays_gemms_on_new_inputs(rt, blas):
    from dsv4rt.cuda.device import Graph, Stream
    from dsv4rt.model.gemm import grouped_linear, linear
    rng = np.random.default_rng(3)
    m, k, n, groups = 16, 1024, 4096, 4
    w1, w2 = random(rng, (n, k), k ** -0.5), random(rng, (groups, 256, n // groups), 0.03)
    dx, dw1, dw2 = upload(rt, np.zeros((m, k), BF16)), upload(rt, w1.astype(BF16)), upload(rt, w2.astype(BF16))
    dh, dy = poisoned(rt, (m, n), BF16), poisoned(rt, (m, groups, 256), np.float32)
    first = linear(blas, BF16, dx.ptr, dw1.ptr, dh.ptr, m, n, k)
    second = grouped_linear(blas, BF16, dh.ptr, dw2.ptr, dy.ptr, m, groups, 256, n // groups, np.float32)
    stream = Stream()  # a stream the handle has not seen: the capture itself sets stream and workspace
    graph = Graph(stream)
    with graph:
        first(stream)
        second(stream)
    for trial in range(2):
        x = random(rng, (m, k))
        dx.copy_from_host(x.astype(BF16))
        graph.replay()
        stream.synchronize()
        y = dy.copy_to_host(np.empty((m, groups, 256), np.float32))
        h = (x.astype(np.float64) @ w1.T.astype(np.float64)).astype(BF16).astype(np.float64)
        ref = np.einsum("mgk,gnk->mgn", h.reshape(m, groups, -1), w2.astype(np.float64))
        assert rel_rows(y.reshape(m, -1), ref.reshape(m, -1)).max() < 1e-2
    graph.close()
    stream.close()
    for b in (dx, dw1, dw2, dh, dy):
        b.free()
