"""cuda_src/hc.cu against the numpy reference: stream embedding, mHC pre/post and the final head."""
import ml_dtypes
import numpy as np
import pytest

from conftest import rel_rows
from dsv4rt.reference.hc import HyperConnection, HyperHead

pytestmark = pytest.mark.gpu
BF16 = ml_dtypes.bfloat16
EPS, HC_EPS, ITERS = 1e-6, 1e-6, 20
# (tokens, hc, dim): Flash, tiny-a, odd dims (100: bf16 rows not 16-byte multiples; 101: scalar everywhere),
# decode batches (hc_pre_decode: one token, groups of 8, then 16) and batches long enough (4224 tokens and more on a
# 132-SM H200) for the shared-memory fn tiles of hc_pre/head.
SHAPES = [(1, 4, 4096), (7, 4, 4096), (300, 4, 4096), (1, 2, 64), (7, 2, 64), (300, 2, 64), (7, 4, 100),
          (300, 2, 100), (7, 2, 101), (1, 4, 101), (8, 4, 4096), (64, 4, 4096), (64, 2, 101), (33, 4, 100),
          (1100, 4, 4096), (3000, 2, 64), (8192, 2, 64), (4500, 4, 100), (4500, 2, 101)]
# More decode batch sizes either side of hc_pre_decode's token groups, at Flash sizes and odd dims.
DECODE_SHAPES = [(2, 4, 4096), (16, 4, 4096), (17, 4, 4096), (100, 4, 4096), (2, 2, 101), (8, 2, 101),
                 (16, 4, 100), (17, 2, 101), (100, 4, 100), (1, 2, 101)]
DTYPES = [np.float32, BF16]


def poison(shape, dtype) -> np.ndarray:
    return np.full(shape, np.nan, dtype)


def fetch(rt, buf, like: np.ndarray) -> np.ndarray:
    rt.stream.synchronize()
    return buf.copy_to_host(np.empty_like(like)).astype(np.float32)


def streams(rng, tokens, hc, dim, dtype) -> np.ndarray:
    return rng.standard_normal((tokens, hc, dim), dtype=np.float32).astype(dtype)


def mixing(rng, rows, hc, dim, n_scale):
    fn = (rng.standard_normal((rows, hc * dim), dtype=np.float32) / np.sqrt(hc * dim)).astype(np.float32)
    base = (0.5 * rng.standard_normal(rows)).astype(np.float32)
    scale = rng.uniform(0.5, 1.5, n_scale).astype(np.float32)
    return fn, base, scale


def out_tol(dtype) -> float:
    return 1e-5 if dtype == np.float32 else 1e-2  # bf16: one rounding of the stored output


def workspace(dev, tokens, hc, dim):
    from dsv4rt.model import hc as k
    return dev(np.zeros(k.pre_workspace_bytes(tokens, hc, dim), np.uint8))


def run_pre(rt, dev, dtype, tokens, hc, dim, iters, seed):
    from dsv4rt.model import hc as k
    rng = np.random.default_rng(seed)
    x = streams(rng, tokens, hc, dim, dtype)
    fn, base, scale = mixing(rng, (2 + hc) * hc, hc, dim, 3)
    du, dpost, dcomb = dev(poison((tokens, dim), dtype)), dev(poison((tokens, hc), np.float32)), \
        dev(poison((tokens, hc, hc), np.float32))
    dx = dev(x)
    launch = k.pre(rt.device, dtype, du.ptr, dpost.ptr, dcomb.ptr, dx.ptr, dev(fn).ptr, dev(base).ptr,
                   dev(scale).ptr, tokens, hc, dim, EPS, HC_EPS, iters, workspace=workspace(dev, tokens, hc, dim).ptr)
    launch(rt.stream)
    got = (fetch(rt, du, np.empty((tokens, dim), dtype)), fetch(rt, dpost, np.empty((tokens, hc), np.float32)),
           fetch(rt, dcomb, np.empty((tokens, hc, hc), np.float32)))
    ref = HyperConnection(fn, base, scale, iters, HC_EPS, EPS).pre(x.astype(np.float32))
    return got, ref, launch


def check_pre(got, ref, dtype):
    (u, post, comb), (ru, rpost, rcomb) = got, ref
    assert rel_rows(u, ru).max() < out_tol(dtype)
    assert rel_rows(post, rpost).max() < 1e-5  # float32 outputs from the same (rounded) inputs
    assert rel_rows(comb, rcomb).max() < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, hc, dim", SHAPES + DECODE_SHAPES)
def test_pre_matches_reference(rt, dev, dtype, tokens, hc, dim):
    got, ref, _ = run_pre(rt, dev, dtype, tokens, hc, dim, ITERS, tokens * 31 + hc * dim)
    check_pre(got, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, hc, dim", [(1, 4, 4096), (8, 4, 4096), (17, 4, 4096), (64, 4, 4096), (7, 2, 101),
                                             (33, 4, 100), (100, 2, 101), (600, 4, 4096)])
def test_pre_with_norm_writes_the_normed_input(rt, dev, dtype, tokens, hc, dim):
    """xn = RMSNorm(u)·w: inside the decode kernel for decode batches, a second launch past them (600 tokens)."""
    from dsv4rt.model import hc as k
    from dsv4rt.reference.ops import rmsnorm
    rng = np.random.default_rng(tokens + dim)
    x = streams(rng, tokens, hc, dim, dtype)
    fn, base, scale = mixing(rng, (2 + hc) * hc, hc, dim, 3)
    w = rng.uniform(0.5, 1.5, dim).astype(np.float32)
    du, dxn = dev(poison((tokens, dim), dtype)), dev(poison((tokens, dim), dtype))
    outs = [dev(poison((tokens, hc), np.float32)), dev(poison((tokens, hc, hc), np.float32))]
    k.pre(rt.device, dtype, du.ptr, outs[0].ptr, outs[1].ptr, dev(x).ptr, dev(fn).ptr, dev(base).ptr, dev(scale).ptr,
          tokens, hc, dim, EPS, HC_EPS, ITERS, xn=dxn.ptr, norm=dev(w).ptr, norm_eps=EPS,
          workspace=workspace(dev, tokens, hc, dim).ptr)(rt.stream)
    u = fetch(rt, du, np.empty((tokens, dim), dtype))
    ref_u = HyperConnection(fn, base, scale, ITERS, HC_EPS, EPS).pre(x.astype(np.float32))[0]
    assert rel_rows(u, ref_u).max() < out_tol(dtype)
    assert rel_rows(fetch(rt, dxn, u.astype(dtype)), rmsnorm(u, w, EPS)).max() < out_tol(dtype)


@pytest.mark.parametrize("dtype, tokens, hc, dim", [(BF16, 7, 4, 4096), (BF16, 1100, 4, 4096), (BF16, 600, 2, 4992),
                                                     (np.float32, 1100, 4, 4096), (BF16, 4500, 4, 100)])
def test_pre_quantises_the_normed_input(rt, dev, dtype, tokens, hc, dim):
    """With xq, xs: act_quant(xn) byte for byte as fp8.act_quant gives it, from inside the finish of bf16 prefill
    steps (1100 and 600 tokens; 4992 columns: the kept chunks and the long rows' loop) and as a launch after the
    others (decode, float32, 100 columns: the CUDA-core projection)."""
    from dsv4rt.model import fp8, hc as k
    rng = np.random.default_rng(tokens + dim + 1)
    x = streams(rng, tokens, hc, dim, dtype)
    fn, base, scale = mixing(rng, (2 + hc) * hc, hc, dim, 3)
    w = rng.uniform(0.5, 1.5, dim).astype(np.float32)
    du, dxn = dev(poison((tokens, dim), dtype)), dev(poison((tokens, dim), dtype))
    cols = fp8.scale_columns(dim)
    dq, ds = dev(np.full((tokens, dim), 0xAB, np.uint8)), dev(np.full((tokens, cols), 0xAB, np.uint8))
    outs = [dev(poison((tokens, hc), np.float32)), dev(poison((tokens, hc, hc), np.float32))]
    k.pre(rt.device, dtype, du.ptr, outs[0].ptr, outs[1].ptr, dev(x).ptr, dev(fn).ptr, dev(base).ptr, dev(scale).ptr,
          tokens, hc, dim, EPS, HC_EPS, ITERS, xn=dxn.ptr, norm=dev(w).ptr, norm_eps=EPS,
          workspace=workspace(dev, tokens, hc, dim).ptr, xq=dq.ptr, xs=ds.ptr)(rt.stream)
    wq, ws = dev(np.zeros((tokens, dim), np.uint8)), dev(np.zeros((tokens, cols), np.uint8))
    fp8.act_quant(rt.device, dtype, wq.ptr, ws.ptr, dxn.ptr, tokens, dim)(rt.stream)
    rt.stream.synchronize()
    for got, want, shape in ((dq, wq, (tokens, dim)), (ds, ws, (tokens, cols))):
        assert np.array_equal(got.copy_to_host(np.empty(shape, np.uint8)), want.copy_to_host(np.empty(shape, np.uint8)))
    with pytest.raises(ValueError, match="needs xn"):
        k.pre(rt.device, dtype, du.ptr, outs[0].ptr, outs[1].ptr, 1, 2, 3, 4, tokens, hc, dim, EPS, HC_EPS, ITERS,
              workspace=1, xq=dq.ptr, xs=ds.ptr)


def test_pre_decode_batches_take_the_decode_kernel(rt):
    from dsv4rt.model import hc as k
    cases = [(1, "hc_pre_decode<__nv_bfloat16,4,1>", (128, 1)), (8, "hc_pre_decode<__nv_bfloat16,4,8>", (128, 1)),
             (16, "hc_pre_decode<__nv_bfloat16,4,16>", (128, 1)), (64, "hc_pre_decode<__nv_bfloat16,4,16>", (32, 4)),
             (4 * rt.device.sm_count + 1, "hc_pre<float,4>", None)]
    for tokens, name, grid in cases:
        dtype = np.float32 if name.startswith("hc_pre<float") else BF16
        launch = k.pre(rt.device, dtype, 0, 0, 0, 0, 0, 0, 0, tokens, 4, 4096, EPS, HC_EPS, ITERS, workspace=1 << 20)
        assert launch.kernel.name == name, (tokens, launch.kernel.name)
        assert grid is None or launch.grid[:2] == grid, (tokens, launch.grid)
    # past them the bf16 build projects on the tensor cores (529 tokens: 9 blocks of 64, 256 k tiles in 29 slices
    # of 9, about PROJECT_BLOCKS blocks) and finishes a token a block
    tokens = 4 * rt.device.sm_count + 1
    project, finish = k.pre(rt.device, BF16, 0, 0, 0, 0, 0, 0, 0, tokens, 4, 4096, EPS, HC_EPS, ITERS,
                            workspace=1 << 20).launches
    assert (project.kernel.name, finish.kernel.name) == ("hc_project_mma<4>", "hc_pre_finish<__nv_bfloat16,4>")
    assert finish.grid[0] == tokens
    if tokens == 529:
        assert project.grid[:2] == (9, 29)
    with pytest.raises(ValueError, match="workspace"):
        k.pre(rt.device, BF16, 0, 0, 0, 0, 0, 0, 0, 1, 4, 4096, EPS, HC_EPS, ITERS)


def test_pre_decode_is_deterministic_replays_and_leaves_its_counters_at_zero(rt, dev):
    """Decode launches of different sizes share one workspace in turn: each is right, repeats bit for bit, eagerly and
    from a CUDA graph, and leaves the workspace's counters at zero for the next."""
    from dsv4rt.cuda.device import Graph
    from dsv4rt.model import hc as k
    hc, dim, most = 4, 4096, 100
    rng = np.random.default_rng(5)
    x = streams(rng, most, hc, dim, BF16)
    fn, base, scale = mixing(rng, (2 + hc) * hc, hc, dim, 3)
    ref_u = HyperConnection(fn, base, scale, ITERS, HC_EPS, EPS).pre(x.astype(np.float32))[0]
    dx, params, w = dev(x), [dev(fn), dev(base), dev(scale)], dev(np.ones(dim, np.float32))
    ws = workspace(dev, most, hc, dim)
    outs = [dev(poison(shape, dtype)) for shape, dtype in
            [((most, dim), BF16), ((most, hc), np.float32), ((most, hc, hc), np.float32), ((most, dim), BF16)]]

    def run(launch_or_graph):
        for o in outs:
            o.copy_from_host(np.full(o.nbytes, 0xff, np.uint8))
        launch_or_graph()
        rt.stream.synchronize()
        assert not ws.copy_to_host(np.empty(8, np.uint8)).any()  # the counters
        return [o.copy_to_host(np.empty(o.nbytes, np.uint8)) for o in outs]

    for tokens in (64, 1, 17, 8, 100, 1):
        launch = k.pre(rt.device, BF16, outs[0].ptr, outs[1].ptr, outs[2].ptr, dx.ptr, *[p.ptr for p in params],
                       tokens, hc, dim, EPS, HC_EPS, ITERS, xn=outs[3].ptr, norm=w.ptr, norm_eps=EPS, workspace=ws.ptr)
        first = run(lambda: launch(rt.stream))
        u = first[0].view(BF16).reshape(most, dim)[:tokens].astype(np.float32)
        assert rel_rows(u, ref_u[:tokens]).max() < out_tol(BF16), tokens
        assert all(np.array_equal(a, b) for a, b in zip(run(lambda: launch(rt.stream)), first)), tokens
        graph = Graph(rt.stream)
        with graph:
            launch(rt.stream)
        for _ in range(3):
            assert all(np.array_equal(a, b) for a, b in zip(run(graph.replay), first)), tokens
        graph.close()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, dim", [(1, 4096), (7, 4096), (64, 4096), (1, 101), (7, 101), (64, 101), (7, 100)])
def test_pre_fuses_the_previous_post_bit_for_bit(rt, dev, dtype, tokens, dim):
    """pre with fused_post (new streams into another buffer) equals post in place then pre: the streams, u, xn, post
    and comb, bit for bit. Dims 101 and 100: four-column chunks that span two streams, element-wise rows."""
    from dsv4rt.model import hc as k
    hc = 4
    rng = np.random.default_rng(tokens * 3 + dim)
    x = streams(rng, tokens, hc, dim, dtype)
    f = rng.standard_normal((tokens, dim), dtype=np.float32).astype(dtype)
    post_prev = (2 / (1 + np.exp(-rng.standard_normal((tokens, hc))))).astype(np.float32)
    comb_prev = rng.uniform(0, 2 / hc, (tokens, hc, hc)).astype(np.float32)
    fn, base, scale = mixing(rng, (2 + hc) * hc, hc, dim, 3)
    params = [dev(a).ptr for a in (fn, base, scale)]
    prev = [dev(a).ptr for a in (f, post_prev, comb_prev)]
    w = dev(rng.uniform(0.5, 1.5, dim).astype(np.float32))

    def run(fused: bool):
        x_old = dev(x)
        dx = dev(poison(x.shape, dtype)) if fused else x_old
        outs = [dev(poison(shape, t)) for shape, t in [((tokens, dim), dtype), ((tokens, dim), dtype),
                                                         ((tokens, hc), np.float32), ((tokens, hc, hc), np.float32)]]
        if not fused:
            k.post(rt.device, dtype, dx.ptr, dx.ptr, *prev, tokens, hc, dim)(rt.stream)
        k.pre(rt.device, dtype, outs[0].ptr, outs[2].ptr, outs[3].ptr, dx.ptr, *params, tokens, hc, dim, EPS, HC_EPS,
              ITERS, xn=outs[1].ptr, norm=w.ptr, norm_eps=EPS, workspace=workspace(dev, tokens, hc, dim).ptr,
              fused_post=(x_old.ptr, *prev) if fused else None)(rt.stream)
        rt.stream.synchronize()
        return [b.copy_to_host(np.empty(b.nbytes, np.uint8)) for b in (dx, *outs)]

    want, got = run(False), run(True)
    ref = HyperConnection.post(x.astype(np.float32), f.astype(np.float32), post_prev, comb_prev)
    assert rel_rows(want[0].view(dtype).reshape(x.shape).astype(np.float32), ref).max() < out_tol(dtype)
    for name, a, b in zip(("X", "u", "xn", "post", "comb"), want, got):
        assert np.array_equal(a, b), name


def test_pre_fused_post_argument_checks():
    """fused_post only on decode batches, and only out of place (no GPU needed: checked before any kernel)."""
    from types import SimpleNamespace
    from dsv4rt.model import hc as k
    device = SimpleNamespace(sm_count=132)
    u, post, comb, x = 1, 2, 3, 4

    def pre(tokens, fused):
        return k.pre(device, BF16, u, post, comb, x, 5, 6, 7, tokens, 4, 4096, EPS, HC_EPS, ITERS, workspace=8,
                     fused_post=fused)

    with pytest.raises(ValueError, match="decode batch"):
        pre(k.decode_tokens(device.sm_count) + 1, (9, 10, 11, 12))
    for fused in [(x, 10, 11, 12), (9, 10, post, 12), (9, 10, 11, comb)]:
        with pytest.raises(ValueError, match="other buffers"):
            pre(1, fused)


@pytest.mark.parametrize("iters", [0, 1, 2, 5])
def test_pre_sinkhorn_iteration_counts(rt, dev, iters):
    got, ref, _ = run_pre(rt, dev, np.float32, 9, 4, 64, iters, iters)
    check_pre(got, ref, np.float32)


def test_pre_flash_long_batch(rt, dev):
    """8192 Flash tokens in bf16; one timed launch on the first n of them gives the rate (n = 8192, either side
    of the shared-memory tile threshold, and decode batches)."""
    from dsv4rt.cuda.device import Event
    from dsv4rt.model import hc as k
    tokens, hc, dim = 8192, 4, 4096
    got, ref, launch = run_pre(rt, dev, BF16, tokens, hc, dim, ITERS, 8)
    check_pre(got, ref, BF16)
    ws = workspace(dev, tokens, hc, dim)
    pointers = [dev(np.zeros(n, np.uint8)).ptr for n in (tokens * dim * 2, tokens * hc * 4, tokens * hc * hc * 4,
                                                         tokens * hc * dim * 2, (2 + hc) * hc * hc * dim * 4,
                                                         (2 + hc) * hc * 4, 12)]
    for n in (tokens, 4224, 4192, 1024, 64, 1):
        again = k.pre(rt.device, BF16, *pointers, n, hc, dim, EPS, HC_EPS, ITERS, workspace=ws.ptr)
        start, end = Event(), Event()
        rt.stream.record(start)
        again(rt.stream)
        rt.stream.record(end)
        end.synchronize()
        ms = start.elapsed_ms(end)
        kernels = " + ".join(l.kernel.name for l in getattr(again, "launches", [again]))
        print(f"\nhc_pre bf16 {n}x{hc}x{dim} {kernels}: {ms * 1e3:.0f} us, "
              f"{n * (hc + 1) * dim * 2 / ms / 1e6:.0f} GB/s of streams in + u out")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, hc, dim", SHAPES)
def test_head_matches_reference(rt, dev, dtype, tokens, hc, dim):
    from dsv4rt.model import hc as k
    rng = np.random.default_rng(tokens * 7 + dim)
    x = streams(rng, tokens, hc, dim, dtype)
    fn, base, scale = mixing(rng, hc, hc, dim, 1)
    dy = dev(poison((tokens, dim), dtype))
    k.head(rt.device, dtype, dy.ptr, dev(x).ptr, dev(fn).ptr, dev(base).ptr, dev(scale).ptr, tokens, hc, dim,
           EPS, HC_EPS)(rt.stream)
    ref = HyperHead(fn, base, scale, HC_EPS, EPS)(x.astype(np.float32))
    assert rel_rows(fetch(rt, dy, np.empty((tokens, dim), dtype)), ref).max() < out_tol(dtype)


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, hc, dim", SHAPES[:10])
def test_post_matches_reference(rt, dev, dtype, tokens, hc, dim, in_place):
    from dsv4rt.model import hc as k
    rng = np.random.default_rng(tokens * 5 + dim + in_place)
    x = streams(rng, tokens, hc, dim, dtype)
    f = rng.standard_normal((tokens, dim), dtype=np.float32).astype(dtype)
    post = (2 / (1 + np.exp(-rng.standard_normal((tokens, hc))))).astype(np.float32)
    comb = rng.uniform(0, 2 / hc, (tokens, hc, hc)).astype(np.float32)
    dx = dev(x)
    dout = dx if in_place else dev(poison(x.shape, dtype))
    k.post(rt.device, dtype, dout.ptr, dx.ptr, dev(f).ptr, dev(post).ptr, dev(comb).ptr, tokens, hc, dim)(rt.stream)
    ref = HyperConnection.post(x.astype(np.float32), f.astype(np.float32), post, comb)
    assert rel_rows(fetch(rt, dout, x), ref).max() < out_tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, hc, dim", [(1, 4, 4096), (7, 2, 64), (300, 4, 4096), (300, 2, 101), (7, 4, 100)])
def test_embed_copies_rows_into_every_stream(rt, dev, dtype, tokens, hc, dim):
    from dsv4rt.model import hc as k
    vocab = 1000
    rng = np.random.default_rng(tokens + dim)
    table = rng.standard_normal((vocab, dim), dtype=np.float32).astype(dtype)
    ids = rng.integers(0, vocab, tokens).astype(np.int32)
    ids[1::5] = np.resize(np.array([-1, vocab, 2**31 - 1, vocab - 1, 0], np.int32), len(ids[1::5]))
    dx = dev(poison((tokens, hc, dim), dtype))
    k.embed(rt.device, dtype, dx.ptr, dev(ids).ptr, dev(table).ptr, tokens, vocab, hc, dim)(rt.stream)
    rt.stream.synchronize()
    got = dx.copy_to_host(np.empty((tokens, hc, dim), dtype))
    rows = table[np.clip(ids, 0, vocab - 1)]
    rows[(ids < 0) | (ids >= vocab)] = 0  # out-of-range ids give zero rows, never a read out of bounds
    assert got.tobytes() == np.repeat(rows[:, None, :], hc, axis=1).tobytes()


def test_empty_batch_launches_nothing(rt):
    from dsv4rt.model import hc as k
    for launch in (k.embed(rt.device, BF16, 0, 0, 0, 0, 10, 4, 64),
                   k.pre(rt.device, BF16, 0, 0, 0, 0, 0, 0, 0, 0, 4, 64, EPS, HC_EPS, ITERS),
                   k.head(rt.device, BF16, 0, 0, 0, 0, 0, 0, 4, 64, EPS, HC_EPS),
                   k.post(rt.device, BF16, 0, 0, 0, 0, 0, 0, 4, 64)):
        assert launch is k.NOTHING
        launch(rt.stream)
    rt.stream.synchronize()
