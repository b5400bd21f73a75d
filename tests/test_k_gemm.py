"""Dense GEMMs (cuBLAS, and the skinny kernel for bf16 decode batches) against numpy: Flash shapes, odd
shapes, the grouped output projection, alpha, graph capture, determinism."""
import functools

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
        dx.copy_from_host(x.astype(BF16), stream)  # a pageable copy may return before its DMA lands
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


# Every decode GEMM of Flash: (k, n, out_dtype, groups, alpha).
FLASH = {"wq_a": (4096, 1024, BF16, 1, 1.0), "wq_b": (1024, 32768, BF16, 1, 1.0), "wkv": (4096, 512, BF16, 1, 1.0),
         "compressor": (4096, 1024, np.float32, 1, 1.0), "compressor_indexer": (4096, 256, np.float32, 1, 1.0),
         "indexer_wq_b": (1024, 8192, BF16, 1, 1.0), "weights_proj": (4096, 64, np.float32, 1, 0.0110485),
         "wo_b": (8192, 4096, BF16, 1, 1.0), "wo_a": (4096, 1024, BF16, 8, 1.0),
         "shared_w1": (4096, 2048, np.float32, 1, 1.0), "shared_w2": (2048, 4096, np.float32, 1, 1.0),
         "head": (4096, 129280, np.float32, 1, 1.0)}
ODD = {"n77_k24": (24, 77, BF16, 1, 1.0), "n1000_k1032": (1032, 1000, np.float32, 1, 0.5),
       "n17_k8": (8, 17, BF16, 1, 1.0), "n515_k1000": (1000, 515, BF16, 1, 2.0),
       "grouped_odd": (40, 24, np.float32, 3, 1.0)}


@functools.cache
def weight(k, n, groups):
    """w [groups, n, k], float32 on the bf16 grid; rows are windows 61 elements apart in one pool (as lm_head):
    distinct rows from few random numbers."""
    rows = groups * n
    pool = random(np.random.default_rng(rows + k), ((rows - 1) * 61 + k,), k ** -0.5)
    return np.lib.stride_tricks.as_strided(pool, (groups, n, k), (61 * n * 4, 61 * 4, 4)).copy()


def skinny(rt, x, w, y, m, k, n, out_dtype, groups, alpha, config=None):
    """The skinny kernel itself, whichever way gemm.linear would route the shape: y [m, groups, n] from
    x [m, groups, k] and w [groups, n, k] (grouped_linear's layout, linear's for one group)."""
    from dsv4rt.model.gemm import skinny_gemm
    return skinny_gemm(rt.device, out_dtype, x, w, y, m, n, k, x_ld=groups * k, y_ld=groups * n, groups=groups,
                       x_step=k, w_step=n * k, y_step=n, alpha=alpha, config=config)


def check_skinny(rt, shape, m, seed, config=None):
    """y [m, groups, n] against numpy's float32 product of the same bf16 values, per row: bf16 output within
    its rounding, float32 output within fp32 summation."""
    k, n, out_dtype, groups, alpha = shape
    w, x = weight(k, n, groups), random(np.random.default_rng(seed), (m, groups, k))
    dx, dw, dy = upload(rt, x.astype(BF16)), upload(rt, w.astype(BF16)), poisoned(rt, (m, groups, n), out_dtype)
    skinny(rt, dx.ptr, dw.ptr, dy.ptr, m, k, n, out_dtype, groups, alpha, config)(rt.stream)
    rt.stream.synchronize()
    y = dy.copy_to_host(np.empty((m, groups, n), out_dtype)).astype(np.float32)
    ref = alpha * np.stack([x[:, g] @ w[g].T for g in range(groups)], axis=1)
    assert rel_rows(y.reshape(m, -1), ref.reshape(m, -1)).max() < (1e-2 if out_dtype == BF16 else 1e-5)
    for b in (dx, dw, dy):
        b.free()


@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("shape", [*FLASH, *ODD])
def test_skinny_gemm_matches_numpy(rt, shape, m):
    check_skinny(rt, FLASH.get(shape) or ODD[shape], m, seed=m)


@pytest.mark.parametrize("out_dtype", [BF16, np.float32])
@pytest.mark.parametrize("config", [(1, 4, 1, 1), (1, 1, 4, 1), (2, 2, 2, 2), (2, 1, 16, 8), (1, 2, 8, 4),
                                    (2, 16, 1, 1), (1, 1, 1, 8), (2, 4, 4, 4)])
def test_every_skinny_layout_matches_numpy(rt, config, out_dtype):
    """Each way to lay the work out (row tiles, row groups a block, warps a row group, cluster split), whichever
    skinny_config picks, on a grouped product with ragged m, n and k."""
    check_skinny(rt, (1000, 77, out_dtype, 3, 0.5), 13, seed=13, config=config)


def test_gemm_path_follows_dtype_rows_width_and_alignment(rt, blas):
    from dsv4rt.model.gemm import M_SKINNY, Blas, Gemm, grouped_linear, linear
    p = 1 << 20  # addresses are not touched: a Gemm only binds them
    for shape, (k, n, out_dtype, groups, alpha) in FLASH.items():
        for m in (1, 8, 16):
            gemm = grouped_linear(blas, BF16, p, p, p, m, groups, n, k, out_dtype) if groups > 1 else \
                linear(blas, BF16, p, p, p, m, n, k, out_dtype, alpha)
            narrow = shape in ("wq_a", "wkv", "compressor", "compressor_indexer", "weights_proj", "shared_w1") or \
                (shape in ("wo_b", "shared_w2") and m <= 8)  # cuBLAS streams the wider weights faster
            assert (gemm.launch is not None) == narrow, (shape, m)
    assert linear(blas, BF16, p, p, p, M_SKINNY, 1024, 4096).launch is not None
    assert linear(blas, BF16, p, p, p, M_SKINNY + 1, 1024, 4096).launch is None
    assert linear(blas, np.float32, p, p, p, 1, 1024, 4096).launch is None
    assert linear(blas, BF16, p, p, p, 1, 1024, 4092).launch is None   # rows not 16-byte vectors
    assert linear(blas, BF16, p + 8, p, p, 1, 1024, 4096).launch is None
    assert Gemm(blas, BF16, p, p, p, 1, 1024, 4096, x_ld=4100).launch is None
    cublas_only = Blas(rt.arena)
    assert linear(cublas_only, BF16, p, p, p, 1, 1024, 4096).launch is None
    cublas_only.close()


@pytest.mark.parametrize("shape, m", [("wkv", 16), ("weights_proj", 3), ("wq_b", 8), ("wo_a", 5), ("wo_b", 1),
                                      ("shared_w1", 16)])
def test_skinny_gemm_is_deterministic(rt, shape, m):
    """Two runs and a graph replay give the same bits (split k sums in a fixed order)."""
    from dsv4rt.cuda.device import Graph, Stream
    k, n, out_dtype, groups, alpha = FLASH[shape]
    x = random(np.random.default_rng(7), (m, groups, k))
    dx, dw, dy = upload(rt, x.astype(BF16)), upload(rt, weight(k, n, groups).astype(BF16)), \
        poisoned(rt, (m, groups, n), out_dtype)
    gemm = skinny(rt, dx.ptr, dw.ptr, dy.ptr, m, k, n, out_dtype, groups, alpha)
    results = []
    for _ in range(2):
        dy.copy_from_host(np.full((m, groups, n), np.nan, out_dtype))
        gemm(rt.stream)
        rt.stream.synchronize()
        results.append(dy.copy_to_host(np.empty((m, groups, n), out_dtype)))
    stream = Stream()
    graph = Graph(stream)
    with graph:
        gemm(stream)
    dy.copy_from_host(np.full((m, groups, n), np.nan, out_dtype))
    graph.replay()
    stream.synchronize()
    results.append(dy.copy_to_host(np.empty((m, groups, n), out_dtype)))
    graph.close()
    stream.close()
    bits = [r.view(np.uint16 if out_dtype == BF16 else np.uint32) for r in results]
    assert not np.isnan(results[0].astype(np.float32)).any()
    assert all(np.array_equal(bits[0], b) for b in bits[1:])
    for b in (dx, dw, dy):
        b.free()
