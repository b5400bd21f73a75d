"""Faithful-mode indexer keys on the GPU (docs/numerics.md#indexer-rounding): compress_pool storing the indexer cache as packed
entries (the Hadamard-rotated key's e2m1 codes and e8m0 scales: the bytes of reference.layouts.encode_indexer_key),
indexer_select rotating and rounding q in place (reference.quant.indexer_round) and scoring from the packed keys.

The kernels rotate their own float32 values, a few ulps from numpy's (other summation orders, rsqrtf, sincosf). So
random rows are checked field by field against what the reference's rounding gives for some value within a bound
of the exact rotation of the numpy value (one answer almost everywhere). Constructed rows must match byte for byte:
rotations designed far from rounding midpoints and scale boundaries (width 128), rows both sides rotate exactly,
where ties to even and scale boundaries are hit exactly (widths 16 and 64, whose 1/sqrt(n) is a power of two; one
nonzero value at width 128), and rows of zeros. Scores are checked against numpy on the keys the entries decode to
and the q the kernel stored: both exact on their grids, so the tensor-core build is held as tight as the float32
one, up to its summation order."""
import ml_dtypes
import numpy as np
import pytest

from conftest import FIXTURES, skip_without_wgmma
from test_k_attention import PagedHost
from test_k_compress import (PagePool, Uploads, check_selection, index_weights, indexer_reference, inv_freq_table,
                             page_table)
from dsv4rt.config import ModelConfig
from dsv4rt.kv import plan
from dsv4rt.kv.entries import indexer_entry_bytes
from dsv4rt.model.compress import hadamard_size
from dsv4rt.model.paged import PagedCache
from dsv4rt.reference import layouts
from dsv4rt.reference.compressor import Compressor
from dsv4rt.reference.ops import Rope
from dsv4rt.reference.quant import E2M1_MAX, hadamard, indexer_round, pow2_scale, rotate, round_e2m1

gpu = pytest.mark.gpu
BF16 = ml_dtypes.bfloat16
DTYPES = [np.float32, BF16]
EPS = 1e-6
BLOCK = 32
GRID = np.array([0, .5, 1, 1.5, 2, 3, 4, 6])
POOL_ERR = 2.0 ** -15   # |GPU - numpy| of compress_pool's values before the rotation, relative to |value| + row rms
Q_ERR = 2.0 ** -18      # of the indexer's q after the kernel's rope (fusion 3's bound in test_k_kv_fp8)
ROT_ERR = 2.0 ** -20    # of the kernel's float32 rotation, relative to the row's sum of |values|
# Keys and q are exact in both builds: the tensor cores multiply them exactly and accumulate in float32.
SCORE_TOL = {np.float32: 1e-5, BF16: 1e-4}
POOL_WIDTHS = {"flash": (128, 64), "tiny": (16, 16), "odd": (96, 32), "narrow": (64, 16)}  # width, rope_dim


def fill_ff(pool):
    pool[:] = 0xFF


# ---------------------------------------------------------------- what a key or a query may hold

def block_scales(mag: np.ndarray) -> np.ndarray:
    """The power-of-two scale of each 32-value block of mag [m, dim] (>= 0), per value."""
    m, dim = mag.shape
    pad = np.zeros((m, -(-dim // BLOCK) * BLOCK))
    pad[:, :dim] = mag
    s = pow2_scale(np.maximum(pad.reshape(m, -1, BLOCK).max(-1), E2M1_MAX * 2.0 ** -126), E2M1_MAX)
    return np.repeat(s, BLOCK, axis=1)[:, :dim].astype(np.float64)


def rotation_bound(x: np.ndarray, err: float) -> np.ndarray:
    """[m, 1]: a bound on the kernel's error in each rotated value of rows x [m, dim], given one of
    err·(|value| + row rms) in each value before the rotation: 1/sqrt(n) times their sum, and the rotation's own."""
    a = np.abs(x.astype(np.float64))
    rms = np.sqrt(np.mean(np.square(a), axis=1, keepdims=True))
    c = float(hadamard(hadamard_size(x.shape[1]))[0, 0])
    return c * (err * (a.sum(1, keepdims=True) + x.shape[1] * rms) + ROT_ERR * a.sum(1, keepdims=True))


def check_keys(got: np.ndarray, x: np.ndarray, delta: np.ndarray, exact=False) -> float:
    """got [m, entry bytes] as stored; x [m, dim] the numpy values before the rotation; delta [m, 1] a bound on the
    kernel's error in each rotated value. Every scale and code must be the reference's rounding of some values
    within delta of the exact rotation of x; exact: the bytes of encode_indexer_key(x). Returns the share of values
    for which the bound admits two codes."""
    m, dim = x.shape
    size = indexer_entry_bytes(np.float32, dim, True)
    if exact:
        assert np.array_equal(got[:, :size], layouts.encode_indexer_key(x.astype(np.float32))), "entry bytes"
        return 0.0
    r = rotate(x.astype(np.float64))
    packed = got[:, :dim // 2].astype(np.int64)
    codes = np.empty((m, dim), np.int64)
    codes[:, 0::2], codes[:, 1::2] = packed & 15, packed >> 4
    s = np.repeat(np.ldexp(1.0, got[:, dim // 2:size].astype(np.int64) - 127), BLOCK, axis=1)[:, :dim]
    s_lo, s_hi = block_scales(np.maximum(np.abs(r) - delta, 0)), block_scales(np.abs(r) + delta)
    assert np.all((s >= s_lo) & (s <= s_hi)), "a scale that no value within the bound gives"
    q = np.where(codes & 8, -GRID[codes & 7], GRID[codes & 7])
    q_lo, q_hi = round_e2m1((r - delta) / s), round_e2m1((r + delta) / s)
    assert np.all((q >= q_lo) & (q <= q_hi)), "a code that no value within the bound rounds to"
    return float(np.mean(q_lo != q_hi))


def check_queries(got: np.ndarray, x: np.ndarray, delta: np.ndarray, exact=False) -> float:
    """check_keys for q stored as values [m, dim] (float32 of the storage type): each the rounding of a value
    within delta, at a scale within the bound; exact: indexer_round(x), bit for bit."""
    if exact:
        want = indexer_round(x.astype(np.float32))
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), "rotated, rounded q"
        return 0.0
    r = rotate(x.astype(np.float64))
    s_lo, s_hi = block_scales(np.maximum(np.abs(r) - delta, 0)), block_scales(np.abs(r) + delta)
    q_lo = np.minimum(round_e2m1((r - delta) / s_lo) * s_lo, round_e2m1((r - delta) / s_hi) * s_hi)
    q_hi = np.maximum(round_e2m1((r + delta) / s_lo) * s_lo, round_e2m1((r + delta) / s_hi) * s_hi)
    assert np.all((got >= q_lo) & (got <= q_hi)), "a q value that no value within the bound rounds to"
    return float(np.mean(q_lo != q_hi))


# ---------------------------------------------------------------- constructed rows

# Rotated blocks in units of their scale s. ROBUST: at least 0.05 from every rounding midpoint, maximum 5.7
# (scale s). ABOVE: maximum 6.3 (scale 2s), the rest ROBUST values in units of 2s. BELOW: maximum 5.95 (scale s).
ROBUST = np.array([5.7, .1, -.2, .3, -.45, .55, -.7, .8, -1.1, 1.2, -1.3, 1.45, -1.6, 1.7, -1.8, 2.2, -2.4, 2.6,
                   -2.9, 3.1, -3.4, 3.6, -3.9, 4.2, -4.8, 5.1, -5.3, .5, -1, 2, -3, 4])
ABOVE = np.concatenate([[6.3], 2 * ROBUST[np.abs(ROBUST) <= 3.1], 2 * np.array([-.1, .2, -.3, 1.1, -2.2, 2.9, -.55,
                                                                                .45])])
BELOW = np.concatenate([[5.95], ROBUST[1:]])
# Every tie of the grid, maximum exactly 6 (scale s); HALF_TIES: maximum exactly 3 (scale s / 2), ties again.
TIES = np.array([6, -.25, .25, -.75, .75, -1.25, 1.25, -1.75, 1.75, -2.5, 2.5, -3.5, 3.5, -5, 5, 0, .5, -.5, 1, -1,
                 1.5, -1.5, 2, -2, 3, -3, 4, -4, -6, 5.5, -4.5, .125])
HALF_TIES = np.array([3, -.125, .125, .375, -.625, .875, -1.125, 1.25, 2.5, -.5, 1, -1.5, 2, -2, .25, 0])


def unrotated(y: np.ndarray) -> np.ndarray:
    """The float32 row whose rotation is y (float64, a power-of-two width): the rotation is an involution."""
    return (y @ hadamard(len(y)).astype(np.float64)).astype(np.float32)


def robust_rows() -> list[np.ndarray]:
    """Width 128: the designed blocks at scales 2^-2 .. 2, over the block positions."""
    blocks, scales = [ROBUST, ABOVE, BELOW, -ROBUST[::-1]], [0.25, 1.0, 2.0, 0.5]
    return [unrotated(np.concatenate([blocks[(b + k) % 4] * scales[(b + 2 * k) % 4] for b in range(4)]))
            for k in range(4)]


def exact_designs() -> list[np.ndarray]:
    """Rotations of widths 16 and 64 made of multiples of 2^-6 whose preimages both sides rotate exactly."""
    return [TIES[:16] * 0.5, HALF_TIES * 2.0,
            np.concatenate([TIES * 0.25, np.concatenate([HALF_TIES, -HALF_TIES[::-1]]) * 4]),
            np.concatenate([-TIES[::-1] * 2, np.zeros(32)])]


def single_rows() -> list[np.ndarray]:
    """Width 128: one nonzero a with float32(a·c) = 5·2^k or 3.5·2^k exactly (c = the rotation's 1/sqrt(128)), so
    every rotated value is ±that, a tie to even at scale 2^k, on both sides."""
    c, rows = hadamard(128)[0, 0], []
    for i, (m, k) in enumerate([(5, -6), (3.5, -2), (5, 1), (3.5, 3)]):
        row = np.zeros(128, np.float32)
        row[17 * i + 3] = np.float32(m * 2.0 ** k / np.float64(c))
        rows.append(row)
    return rows


def grid_rows(rng, n: int, dim: int) -> np.ndarray:
    """Random rows of multiples of 2^-4 under 8 (exact in bf16) that widths 16 and 64 rotate exactly."""
    return (rng.integers(-127, 128, (n, dim)) / 16).astype(np.float32)


def designed_rows(width: int) -> list[np.ndarray]:
    """Every constructed row of a width, and a row of zeros."""
    if width == 128:
        rows = robust_rows() + single_rows()
    else:
        rows = [unrotated(y) for y in exact_designs() if len(y) == width]
    return rows + [np.zeros(width, np.float32)]


# ---------------------------------------------------------------- host side (no GPU)

def test_constructed_rows_are_decided_alike():
    """The exact rows rotate exactly in float32 (the reference's arithmetic); the robust ones admit one answer
    within the compress bound, also after rounding to bf16."""
    for y in exact_designs():
        assert np.array_equal(rotate(unrotated(y)[None])[0], y.astype(np.float32))
    for x in single_rows():
        y = np.abs(rotate(x[None])[0])
        assert len(np.unique(y)) == 1 and y[0] / 2.0 ** np.floor(np.log2(y[0])) in (1.25, 1.75)
    for x in (np.array(robust_rows()), np.array(robust_rows()).astype(BF16).astype(np.float32)):
        assert check_keys(layouts.encode_indexer_key(x), x, rotation_bound(x, POOL_ERR)) == 0
    x = grid_rows(np.random.default_rng(0), 64, 64)
    assert np.array_equal(rotate(x), rotate(x.astype(np.float64)).astype(np.float32))


@pytest.mark.parametrize("dim", [128, 16, 64, 96])
def test_entry_bytes(dim):
    assert indexer_entry_bytes(BF16, dim, True) == indexer_entry_bytes(np.float32, dim, True) == \
        layouts.indexer_entry_bytes(dim)
    assert indexer_entry_bytes(BF16, dim) == 2 * dim and indexer_entry_bytes(np.float32, dim) == 4 * dim
    assert hadamard_size(dim) == len(hadamard(hadamard_size(dim))) >= dim


def test_entries_match_the_plan():
    for name in ("deepseek-v4-flash", "deepseek-v4-pro"):
        cfg = ModelConfig.load(FIXTURES / "configs" / f"{name}.json")
        assert indexer_entry_bytes(BF16, cfg.index_head_dim, True) == plan.indexer_entry_bytes(cfg, "faithful") == 68


def test_launchers_reject_what_the_fp4_kernels_cannot_store():
    from dsv4rt.model.compress import compress_pool, indexer_select

    def pool(width, entry_bytes, **kw):
        compress_pool(None, BF16, PagedCache(256, 0, 0, 64, entry_bytes), PagedCache(256, 0, 0, 8, 1 << 16), 0, 0,
                      0, 0, 0, 0, 0, rows=0, width=width, ratio=4, overlap=True, rope_dim=16, eps=EPS, **kw)

    def select(dtype, dim, entry_bytes):
        indexer_select(None, dtype, 0, 0, 0, 0, PagedCache(256, 0, 0, 64, entry_bytes), 0, 0, rows=0, heads=64,
                       head_dim=dim, topk=512, n_max=1, fp4_keys=True)

    with pytest.raises(ValueError):
        pool(128, 67, fp4_keys=True)
    with pytest.raises(ValueError):
        pool(128, 584, fp4_keys=True, fp8_kv=True)
    with pytest.raises(ValueError):
        select(BF16, 128, 70)   # the tensor-core kernel copies 4-byte words
    with pytest.raises(ValueError):
        select(np.float32, 16, 8)
    pool(128, 68, fp4_keys=True)   # accepted (no rows, no launch)
    pool(16, 9, fp4_keys=True)
    select(BF16, 128, 68)
    select(np.float32, 128, 69)   # the float32 kernel reads bytes
    select(BF16, 16, 9)


# ---------------------------------------------------------------- compress_pool

def pool_run(rt, dev, dtype, width, rope_dim, a, z, ape, norm, freq, eps, rng, signs=(1, 1), spacing=0):
    """One compress_pool launch writing packed keys (ratio 4, overlapping) for two requests from position 0, a
    padding row after each: a long one and one whose only entry is its first; a, z [rows of both, 2·width] (a None:
    every a of request r is signs[r]). Returns the cache (one more entry per request than it completes, which must
    stay untouched) and per request the stored entries and the numpy reference's entries before the rotation."""
    from dsv4rt.model.compress import compress_pool
    lengths, ratio, cd = [1001, 7], 4, 2 * width
    counts = [n // ratio for n in lengths]
    if a is None:
        a = np.concatenate([np.full((n, cd), s, np.float32) for n, s in zip(lengths, signs)])
    out = PagedHost(rng, [np.ones(n // 64 + 1, bool) for n in counts], 64, indexer_entry_bytes(dtype, width, True),
                    np.uint8, spacing, fill_ff)
    pos, req, a_rows, z_rows, at = [], [], [], [], 0
    for r, n in enumerate(lengths):
        pos += [*range(n), ratio - 1]
        req += [r] * n + [-1]
        a_rows += [a[at:at + n], np.full((1, cd), np.nan, np.float32)]
        z_rows += [z[at:at + n], np.full((1, cd), np.nan, np.float32)]
        at += n
    state_bytes, state_page = 2 * cd * 4, max(lengths)
    state = dev(np.zeros(len(lengths) * state_page * state_bytes, np.uint8))
    state_cache = PagedCache(state.ptr, dev(np.arange(len(lengths), dtype=np.int64) * state_page * state_bytes).ptr,
                             dev(np.arange(len(lengths), dtype=np.int32)).ptr, state_page, state_bytes)
    pool, cache = out.upload(dev)
    compress_pool(rt.device, dtype, cache, state_cache, dev(np.vstack(a_rows)).ptr, dev(np.vstack(z_rows)).ptr,
                  dev(ape).ptr, dev(norm).ptr, dev(freq).ptr, dev(np.array(pos, np.int32)).ptr,
                  dev(np.array(req, np.int32)).ptr, rows=len(pos), width=width, ratio=ratio, overlap=True,
                  rope_dim=rope_dim, eps=eps, fp4_keys=True)(rt.stream)
    rt.stream.synchronize()
    pool.copy_to_host(out.pool)

    eye, zero = np.eye(cd, dtype=np.float32), np.zeros((cd, cd), np.float32)
    comp = Compressor(np.hstack([eye, zero]), np.hstack([zero, eye]), ape, norm, ratio, eps, Rope(freq))
    got, ref, at = [], [], 0
    for r, n in enumerate(lengths):
        st = comp.new_state()
        comp.update(st, np.hstack([a[at:at + n], z[at:at + n]]).astype(np.float64), np.arange(n))
        at += n
        got.append(np.array([out.entry(r, j) for j in range(counts[r] + 1)]))
        ref.append(st.entries)
        for j in range(counts[r]):   # bytes between entries stay as they were
            o = out.offset(r, j) + out.width
            assert np.all(out.pool[o:o + spacing] == 0xFF), "compress_pool wrote past an entry"
    return out, got, ref


def completed(got):
    for g in got:
        assert np.all(g[-1] == 0xFF), "an entry not complete yet was written"
    return np.concatenate([g[:-1] for g in got])


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", POOL_WIDTHS)
def test_compress_fp4_entries(rt, dev, case, dtype):
    width, rope_dim = POOL_WIDTHS[case]
    rng = np.random.default_rng([len(case), int(dtype == BF16)])
    rows = 1001 + 7
    a = rng.standard_normal((rows, 2 * width), dtype=np.float32)
    z = 2 * rng.standard_normal((rows, 2 * width), dtype=np.float32)
    ape = rng.standard_normal((4, 2 * width), dtype=np.float32)
    norm = (1 + 0.2 * rng.standard_normal(width)).astype(np.float32)
    _, got, ref = pool_run(rt, dev, dtype, width, rope_dim, a, z, ape, norm, inv_freq_table(rope_dim), EPS, rng,
                           spacing=4 * (case == "flash"))
    e = np.concatenate(ref)
    ambiguous = check_keys(completed(got), e, rotation_bound(e, POOL_ERR))
    assert ambiguous < 0.05, ambiguous


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [128, 64, 16])
def test_compress_fp4_exact_cases(rt, dev, width, dtype):
    """Every a of a request is +1 (the other's -1), so with eps 0 each entry's pooled values are exactly that, its
    mean square 1, and the norm weight sets the entry (RoPE by zero angles): each constructed row, byte for byte."""
    rng = np.random.default_rng([width, int(dtype == BF16)])
    z = 2 * rng.standard_normal((1001 + 7, 2 * width), dtype=np.float32)
    ape = rng.standard_normal((4, 2 * width), dtype=np.float32)
    for x in designed_rows(width):
        _, got, ref = pool_run(rt, dev, dtype, width, 16, None, z, ape, x, np.zeros(8, np.float32), 0.0, rng,
                               signs=(1, -1))
        e = np.concatenate(ref)
        assert np.array_equal(np.abs(e), np.broadcast_to(np.abs(x), e.shape))
        check_keys(completed(got), e, np.zeros((len(e), 1)), exact=True)


# ---------------------------------------------------------------- indexer_select on packed keys

def make_request(rng, dtype, n_keys, positions, heads, dim, keys=None, x=None, q=None):
    keys = rng.standard_normal((n_keys, dim), dtype=np.float32) if keys is None else keys
    q = rng.standard_normal((len(positions), heads, dim), dtype=np.float32) if q is None else q
    x = rng.standard_normal((len(positions), heads), dtype=np.float32) if x is None else x
    entries = layouts.encode_indexer_key(keys) if n_keys else np.zeros((0, layouts.indexer_entry_bytes(dim)), np.uint8)
    return dict(keys=entries, q=q.astype(dtype).astype(np.float32), x=x, pos=np.asarray(positions, np.int32))


def run_fp4_indexer(rt, dtype, requests, *, topk, rope_dim, rope_in_kernel, pad_rows=0, spacing=0, seed=0,
                    cache=None, freq=None, q_exact=False, launched=None):
    """One indexer_select launch (fp4_keys) over the rows of every request, then poisoned padding rows. Keys: each
    request's packed entries (r["keys"]) in pages, `spacing` bytes apart beyond the entry, or `cache` (a PagedCache
    holding them). Checks the rotated, rounded q the kernel stores in place (exact: bit for bit); returns per
    request (selected rows, kernel scores, reference mask and float64 scores on the stored q and the decoded keys,
    visible). freq: the rope table (the layer's by default); the names of the kernels launched are appended to
    `launched`."""
    rng = np.random.default_rng(seed)
    heads, dim = requests[0]["q"].shape[1:]
    freq = inv_freq_table(rope_dim) if freq is None else freq
    size = indexer_entry_bytes(dtype, dim, True)
    entry_bytes, per_page = size + spacing, 64
    up = Uploads(rt)
    pool = None
    if cache is None:
        logical = [-(-len(r["keys"]) // per_page) for r in requests]
        pool = PagePool(rt, sum(logical), per_page * entry_bytes, rng)
        tables = [[pool.take() for _ in range(n)] + [-1] for n in logical]
        for r, table in zip(requests, tables):
            for j0 in range(0, len(r["keys"]), per_page):
                page = np.full((per_page, entry_bytes), 0xFF, np.uint8)
                chunk = r["keys"][j0:j0 + per_page]
                page[:len(chunk), :size] = chunk
                pool.buf.copy_from_host(page.reshape(-1)[:len(chunk) * entry_bytes], rt.stream, table[j0 // per_page])
        pages, start = page_table(tables)
        cache = PagedCache(pool.buf.ptr, up(pages), up(start), per_page, entry_bytes)

    # the q the reference rounds: roped in float32 as it does, or by the caller in the storage type
    pre = [Rope(freq)(r["q"], r["pos"]) for r in requests]
    q_in = [r["q"] if rope_in_kernel else p.astype(dtype).astype(np.float32) for r, p in zip(requests, pre)]
    if not rope_in_kernel:
        pre = q_in
    q_in.append(np.full((pad_rows, heads, dim), np.nan, np.float32))
    w = [index_weights(r["x"], dim) for r in requests] + [np.full((pad_rows, heads), np.nan, np.float32)]
    pos = [r["pos"] for r in requests] + [np.full(pad_rows, 4000, np.int32)]
    req = [np.full(len(r["pos"]), i, np.int32) for i, r in enumerate(requests)] + [np.full(pad_rows, -1, np.int32)]
    rows = sum(len(p) for p in pos)
    visible = [(r["pos"] + 1) // 4 for r in requests]
    n_max = max(1, max(int(v.max(initial=0)) for v in visible))

    d_sel = up(np.full((rows, topk), -7, np.int32))
    d_scores = up(np.full((rows, n_max), np.nan, np.float32))
    d_q = up(np.vstack(q_in).astype(dtype))
    from dsv4rt.model.compress import indexer_select
    launch = indexer_select(rt.device, dtype, d_sel, d_scores, d_q, up(np.vstack(w)), cache, up(np.concatenate(pos)),
                            up(np.concatenate(req)), rows=rows, heads=heads, head_dim=dim, topk=topk, n_max=n_max,
                            inv_freq=up(freq) if rope_in_kernel else None, rope_dim=rope_dim, fp4_keys=True)
    launch(rt.stream)
    if launched is not None:
        launched += [k.kernel.name for k in launch.launches]
    sel = up.fetch(d_sel, np.empty((rows, topk), np.int32))
    scores = up.fetch(d_scores, np.empty((rows, n_max), np.float32))
    q_got = up.fetch(d_q, np.empty((rows, heads, dim), dtype)).astype(np.float32)
    up.free()
    if pool is not None:
        pool.image()
        pool.close()

    assert np.all(sel[rows - pad_rows:] == -1), "padding rows select nothing"
    assert np.isnan(q_got[rows - pad_rows:]).all(), "padding rows' q is left alone"
    real = np.vstack([p.reshape(-1, dim) for p in pre])
    delta = rotation_bound(real, Q_ERR if rope_in_kernel else 0.0)
    ambiguous = check_queries(q_got[:rows - pad_rows].reshape(-1, dim), real, delta, exact=q_exact)
    assert ambiguous < 0.01, ambiguous

    results, row = [], 0
    identity = np.zeros(rope_dim // 2, np.float32)
    for r, v in zip(requests, visible):
        n = len(r["pos"])
        q, keys = q_got[row:row + n], layouts.decode_indexer_key(r["keys"], dim)
        mask = indexer_reference(keys, q, r["x"], r["pos"], topk, identity)
        relu = np.maximum(q.astype(np.float64) @ keys.T.astype(np.float64), 0)
        ref_scores = np.einsum("th,thn->tn", index_weights(r["x"], dim).astype(np.float64), relu)
        results.append((sel[row:row + n], scores[row:row + n], mask, ref_scores, v))
        row += n
    return results


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_indexer_fp4_flash_decode(rt, dtype):
    """Many requests × one query: visible ≫ k, = k ± 1, < k, one entry, none; padding rows."""
    rng = np.random.default_rng(31)
    reqs = []
    for n in [16384, 5000, 513, 512, 511, 100, 1, 0]:
        pos = 4 * n - 1 + int(rng.integers(0, 4)) if n else 2
        reqs.append(make_request(rng, dtype, n, [pos], 64, 128))
    results = run_fp4_indexer(rt, dtype, reqs, topk=512, rope_dim=64, rope_in_kernel=True, pad_rows=3)
    check_selection(results, 512, SCORE_TOL[dtype])


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_indexer_fp4_flash_prefill_chunk(rt, dtype):
    """One chunk of one request whose visible count crosses k; the caller ropes q; entries 4 bytes apart."""
    rng = np.random.default_rng(32)
    p0, n = 1950, 200
    req = make_request(rng, dtype, (p0 + n) // 4, np.arange(p0, p0 + n), 64, 128)
    results = run_fp4_indexer(rt, dtype, [req], topk=512, rope_dim=64, rope_in_kernel=False, spacing=4)
    check_selection(results, 512, SCORE_TOL[dtype])


@gpu
@pytest.mark.parametrize("spacing", [0, 8])
def test_indexer_fp4_prefill_step_on_wgmma(rt, spacing):
    """A bf16 step of two prefill chunks and a decode row, 403 + 301 + 1 rows and 2 of padding (the wgmma kernel on
    sm_90a: its raw tiles of packed entries widened into the bf16 key tile), visible counts crossing k and the
    128-key tiles; entries 68 bytes apart, or 76."""
    skip_without_wgmma(rt)
    rng = np.random.default_rng(35 + spacing)
    reqs = [make_request(rng, BF16, 2303 // 4, np.arange(1900, 2303), 64, 128),
            make_request(rng, BF16, 301 // 4, np.arange(0, 301), 64, 128),
            make_request(rng, BF16, 3000, [4 * 3000 - 1], 64, 128)]
    launched = []
    results = run_fp4_indexer(rt, BF16, reqs, topk=512, rope_dim=64, rope_in_kernel=True, pad_rows=2,
                              spacing=spacing, launched=launched)
    assert "indexer_scores_wgmma<true>" in launched
    check_selection(results, 512, SCORE_TOL[BF16])


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, dim, rope_dim, topk, spacing", [
    (32, 16, 16, 8, 0),     # tiny-a's indexer: 9-byte entries at every byte offset
    (40, 64, 16, 20, 3),    # an odd head count
    (24, 96, 32, 12, 1),    # the rotation pads 96 to 128
])
def test_indexer_fp4_odd_sizes(rt, dtype, heads, dim, rope_dim, topk, spacing):
    rng = np.random.default_rng(heads)
    reqs = [make_request(rng, dtype, 25, np.arange(0, 100), heads, dim),
            make_request(rng, dtype, 21, np.arange(37, 87), heads, dim)]
    results = run_fp4_indexer(rt, dtype, reqs, topk=topk, rope_dim=rope_dim, rope_in_kernel=True, pad_rows=1,
                              spacing=spacing)
    check_selection(results, topk, SCORE_TOL[dtype])


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [128, 64, 16])
def test_indexer_fp4_exact_cases(rt, dtype, dim):
    """q rows (roped by zero angles) the kernel must rotate and round as the reference does, bit for bit: the
    constructed rows (in bf16 those of width 128, which stay decided alike) and, where the rotation is exact, random
    rows on a coarse grid."""
    rng = np.random.default_rng([dim, int(dtype == BF16)])
    heads = 8
    rows = designed_rows(dim) if dtype == np.float32 or dim == 128 else [np.zeros(dim, np.float32)]
    rows = np.array([s * r for r in rows for s in (1, -1)])
    if dim < 128:
        rows = np.vstack([rows, grid_rows(rng, 3 * heads, dim)])
    q = np.resize(rows, (-(-len(rows) // heads) * heads, dim)).reshape(-1, heads, dim)
    req = make_request(rng, dtype, 40, 159 - np.arange(len(q)), heads, dim, q=q)
    results = run_fp4_indexer(rt, dtype, [req], topk=16, rope_dim=min(dim, 64), rope_in_kernel=True,
                              freq=np.zeros(min(dim, 64) // 2, np.float32), q_exact=True)
    check_selection(results, 16, SCORE_TOL[dtype])


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_indexer_fp4_ties_go_to_lower_indices(rt, dtype):
    """Keys drawn from three vectors (identical entries score bit for bit the same) and all-zero weights."""
    rng = np.random.default_rng(33)
    base = rng.standard_normal((3, 128), dtype=np.float32)
    reqs = []
    for n in [2000, 700, 300]:
        reqs.append(make_request(rng, dtype, n, [4 * n - 1, 4 * n - 5], 64, 128, keys=base[rng.integers(0, 3, n)]))
    reqs.append(make_request(rng, dtype, 1500, [5999, 3000], 64, 128, x=np.zeros((2, 64), np.float32)))
    results = run_fp4_indexer(rt, dtype, reqs, topk=512, rope_dim=64, rope_in_kernel=True)
    check_selection(results, 512, SCORE_TOL[dtype], exact=True)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_indexer_fp4_long_context_one_row(rt, dtype):
    rng = np.random.default_rng(34)
    n = 262144   # visible entries of a 1M-token context
    req = make_request(rng, dtype, n, [4 * n - 1], 64, 128)
    check_selection(run_fp4_indexer(rt, dtype, [req], topk=512, rope_dim=64, rope_in_kernel=True), 512,
                    SCORE_TOL[dtype])


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_indexer_fp4_reads_what_compress_pool_writes(rt, dev, dtype):
    """compress_pool fills the cache (68-byte entries, as the plan lays them out); a decode row and a prefill chunk
    of the long request score from it."""
    rng = np.random.default_rng(35)
    width = 128
    a = rng.standard_normal((1008, 2 * width), dtype=np.float32)
    z = 2 * rng.standard_normal((1008, 2 * width), dtype=np.float32)
    ape = rng.standard_normal((4, 2 * width), dtype=np.float32)
    norm = (1 + 0.2 * rng.standard_normal(width)).astype(np.float32)
    out, got, _ = pool_run(rt, dev, dtype, width, 64, a, z, ape, norm, inv_freq_table(64), EPS, rng)
    entries = got[0][:-1]
    cache = out.upload(dev)[1]
    positions = np.concatenate([np.arange(900, 960), [1000]])
    req = make_request(rng, dtype, 0, positions, 64, width)
    req["keys"] = entries
    decode_only = dict(req, pos=req["pos"][-1:], q=req["q"][-1:], x=req["x"][-1:])
    for r in (req, decode_only):
        check_selection(run_fp4_indexer(rt, dtype, [r], topk=64, rope_dim=64, rope_in_kernel=True, cache=cache),
                        64, SCORE_TOL[dtype])
