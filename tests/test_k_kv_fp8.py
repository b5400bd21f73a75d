"""Faithful-mode main KV cache on the GPU (docs/numerics.md#kv-cache-rounding): fusion 3 and compress_pool storing entries with
the nope dims on e4m3 (the bf16 build: the bytes of reference.layouts.encode_kv; the float32 build: float32 rows
holding reference.quant.kv_round's values), and sparse attention reading them.

The kernels round their own float32 values, a few ulps from numpy's (rsqrtf, sincosf, summation order). So
random rows are checked field by field against what the reference's rounding gives for some value within a
bound of the numpy value (exact wherever that leaves one answer, which the ambiguity bounds make almost
everywhere), and constructed rows that both sides compute exactly (e4m3 ties at known scales, zeros of both
signs, block maxima on and past a scale boundary, blocks under the 1e-4 floor) must match byte for byte."""
import ml_dtypes
import numpy as np
import pytest

from conftest import FIXTURES, rel_rows
from test_k_attention import (DECODE_LENGTHS, MODES, PADDING_POSITION, SIZES, WINDOW_PER_PAGE, PagedHost,
                              compressed_cache, inv_freq, reference_attention, rounded, window_cache)
from dsv4rt.config import ModelConfig
from dsv4rt.kv.plan import main_entry_bytes
from dsv4rt.kv.entries import kv_entry_bytes, packed_kv
from dsv4rt.model.paged import PagedCache
from dsv4rt.reference import layouts
from dsv4rt.reference.compressor import Compressor
from dsv4rt.reference.ops import Rope, rmsnorm
from dsv4rt.reference.quant import kv_round, pow2_scale

gpu = pytest.mark.gpu
BF16, E4M3 = ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn
DTYPES = [np.float32, BF16]
EPS = 1e-6
QKV_ERR = 2.0 ** -18   # |GPU - numpy| of fusion 3's float32 values, relative to |value| + row rms
POOL_ERR = 2.0 ** -15  # of compress_pool's (softmax-weighted sums in another order)
POOL_CASES = {"c4a": (512, 64, 4), "c128a": (512, 64, 128), "tiny": (32, 16, 4), "odd": (96, 32, 16)}


# ---------------------------------------------------------------- what an entry may hold

def e4m3(x):
    return np.clip(np.asarray(x, np.float32), -448, 448).astype(E4M3).astype(np.float32)


def bf16(x):
    return np.asarray(x, np.float32).astype(BF16).astype(np.float32)


def block_scales(mag: np.ndarray, nope: int) -> np.ndarray:
    """The power-of-two scale of each 64-value block of the nope dims of mag (>= 0), per value."""
    n, nb = len(mag), -(-nope // 64)
    pad = np.zeros((n, nb * 64), np.float32)
    pad[:, :nope] = mag[:, :nope]
    s = pow2_scale(np.maximum(pad.reshape(n, nb, 64).max(-1), np.float32(1e-4)), 448.0)
    return np.repeat(s, 64, axis=1)[:, :nope].astype(np.float64)


def bound(ref: np.ndarray, err: float) -> np.ndarray:
    return err * (np.abs(ref) + np.sqrt(np.mean(np.square(ref), axis=-1, keepdims=True)))


def check_entries(dtype, got, ref, rd, delta, exact=False):
    """got: entries as stored ([n, kv_entry_bytes] uint8 packed, or [n, hd] float32); ref [n, hd] the numpy
    values after RoPE; delta [n, hd] a bound on the kernel's float32 error. Every stored field must be the
    reference rounding of some value within delta of ref; exact: the nope dims, scales and padding must be
    the reference's bytes (rope dims still within delta). Returns the shares of nope and rope values for
    which the bound admits two answers."""
    ref, delta = ref.astype(np.float64), delta.astype(np.float64)
    n, hd = ref.shape
    nope, nb = hd - rd, -(-(hd - rd) // 64)
    lo, hi = ref - delta, ref + delta
    s_lo, s_hi = block_scales(np.maximum(np.abs(ref) - delta, 0), nope), block_scales(np.abs(ref) + delta, nope)
    if packed_kv(dtype, True):
        want = layouts.encode_kv(ref.astype(np.float32), rd)
        codes, rope, scales, pad = np.split(got, [nope, nope + 2 * rd, nope + 2 * rd + nb], axis=1)
        assert not pad.any(), "padding bytes must be zero"
        if exact:
            assert np.array_equal(got[:, :nope], want[:, :nope]), "nope codes"
            assert np.array_equal(scales, want[:, nope + 2 * rd:nope + 2 * rd + nb]), "scale bytes"
        s = np.repeat(np.ldexp(1.0, scales.astype(np.int64) - 127), 64, axis=1)[:, :nope]
        assert np.all((s >= s_lo) & (s <= s_hi)), "a scale that no value within the bound gives"
        q, q_lo, q_hi = codes.copy().view(E4M3).astype(np.float32), e4m3(lo[:, :nope] / s), e4m3(hi[:, :nope] / s)
        r = rope.copy().view(BF16).astype(np.float32)
        r_lo, r_hi = bf16(lo[:, nope:]), bf16(hi[:, nope:])
    else:
        want = kv_round(ref.astype(np.float32), rd)
        if exact:
            assert np.array_equal(got[:, :nope].view(np.uint32), want[:, :nope].view(np.uint32)), "nope values"
        q = got[:, :nope]
        q_lo = np.minimum(e4m3(lo[:, :nope] / s_lo) * s_lo, e4m3(lo[:, :nope] / s_hi) * s_hi)
        q_hi = np.maximum(e4m3(hi[:, :nope] / s_lo) * s_lo, e4m3(hi[:, :nope] / s_hi) * s_hi)
        r, r_lo, r_hi = got[:, nope:], lo[:, nope:], hi[:, nope:]  # rope dims stay float32
    assert np.all((q >= q_lo) & (q <= q_hi)), "a nope value that no value within the bound rounds to"
    assert np.all((r >= r_lo) & (r <= r_hi)), "a rope value too far from the reference"
    return np.mean(q_lo != q_hi), np.mean(r_lo != r_hi) if packed_kv(dtype, True) else 0.0


def _ties() -> np.ndarray:
    grid = np.unique(np.abs(np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)))
    grid = grid[np.isfinite(grid)]
    return (grid[:-1] + grid[1:]) / 2  # 126 midpoints of the e4m3 grid, 0 .. 448


def _patterns() -> list[np.ndarray]:
    """64-value nope blocks that probe the rounding; the first value sets the block's maximum."""
    rng, t = np.random.default_rng(64), _ties()
    alt = np.where(np.arange(63) % 2, -1, 1)
    blocks = [[448 * 2.0 ** -4, *(t[:63] * alt * 2.0 ** -4)],  # the lower ties at scale 2^-4
              [-448 * 2.0 ** 3, *(t[63:] * alt * 2.0 ** 3)],  # the upper ones at scale 2^3
              np.where(np.arange(64) % 2, -0.0, 0.0),  # zeros of both signs: the floor scale
              [np.nextafter(np.float32(112), np.float32(1e9)), *(t[::2] / 4)],  # one ulp past 448·2^-2: 2^-1
              [400 * 2.0 ** -22, *(t[:63] * alt * 2.0 ** -22)],  # under 1e-4: ties at the floor scale 2^-22
              [0.125, *rng.uniform(-0.125, 0.125, 63)],  # a power-of-two maximum
              rng.standard_normal(64) * np.exp(rng.uniform(-6, 4, 64))]  # magnitudes over four decades
    return [np.array(b, np.float32) for b in blocks]


PATTERNS = _patterns()


def designed_nope(nope: int, shift: int) -> np.ndarray:
    blocks = [PATTERNS[(b + shift) % len(PATTERNS)] for b in range(-(-nope // 64))]
    return np.concatenate(blocks)[:nope]


def fill_ff(pool):
    pool[:] = 0xFF  # NaN in every float32, bf16 and e4m3 field; scale 255 reads as infinity


def entry_layout(dtype, hd, rd) -> tuple:
    """(elements, element type) of one stored faithful entry: packed bytes (bf16 build) or a float32 row."""
    return (kv_entry_bytes(dtype, hd, rd, True), np.uint8) if packed_kv(dtype, True) else (hd, np.float32)


def entry_host(rng, held, per_page, dtype, hd, rd, pad) -> PagedHost:
    return PagedHost(rng, held, per_page, *entry_layout(dtype, hd, rd), pad, fill_ff)


def stored_values(dtype, entries, hd, rd) -> np.ndarray:
    return layouts.decode_kv(entries, hd, rd) if packed_kv(dtype, True) else entries.astype(np.float32)


def faithful_copy(rng, host: PagedHost, keys, dtype, rd, pad):
    """A cache with the page structure of a float32 PagedHost holding the faithful entries of the finite rows
    of keys (per request [n, hd]); returns it and the values it stores (NaN elsewhere)."""
    hd = keys[0].shape[1]
    ends = [*host.page_start[1:], len(host.pages)]
    cache = entry_host(rng, [host.pages[a:b] >= 0 for a, b in zip(host.page_start, ends)], host.per_page, dtype,
                       hd, rd, pad)
    values = []
    for r, k in enumerate(keys):
        v = np.full(k.shape, np.nan, np.float32)
        rows = np.flatnonzero(np.isfinite(k).all(axis=1))
        if len(rows):
            entries = layouts.encode_kv(k[rows], rd) if packed_kv(dtype, True) else kv_round(k[rows], rd)
            for e, row in zip(rows, entries):
                cache.entry(r, e)[:] = row
            v[rows] = stored_values(dtype, entries, hd, rd)
        values.append(v)
    return cache, values


# ---------------------------------------------------------------- fusion 3

def fusion3(rt, dev, dtype, s, rows, q_store, kv_store, weight, freq, win: PagedHost, eps=EPS):
    """Runs fusion 3 with fp8 entries; copies the window back into win.pool. Returns q (device) and the cache."""
    from dsv4rt.model.attention import qkv_norm_rope_insert
    pool, cache = win.upload(dev)
    q = dev(q_store)
    qkv_norm_rope_insert(rt.device, dtype, q.ptr, dev(kv_store).ptr, dev(weight).ptr,
                         dev(np.array([m for _, m in rows], np.int32)).ptr,
                         dev(np.array([r for r, _ in rows], np.int32)).ptr, dev(freq).ptr, cache, rows=len(rows),
                         heads=s["heads"], head_dim=s["hd"], rope_dim=s["rd"], eps=eps, fp8_kv=True)(rt.stream)
    rt.stream.synchronize()
    pool.copy_to_host(win.pool)
    return q, cache


def reference_kv(kv, weight, positions, freq, eps=EPS):
    return Rope(freq)(rmsnorm(kv.astype(np.float64), weight, eps), np.asarray(positions))


def window_rows(win: PagedHost, rows) -> np.ndarray:
    return np.array([win.entry(r, m) for r, m in rows if r >= 0])


@gpu
@pytest.mark.parametrize("layout", ["decode", "prefill"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", SIZES)
def test_fusion3_entries(rt, dev, size, dtype, layout):
    s = SIZES[size]
    hd, rd = s["hd"], s["rd"]
    rng = np.random.default_rng([len(size), len(layout), int(dtype == BF16)])
    if layout == "decode":
        rows, lengths = [(r, n - 1) for r, n in enumerate(DECODE_LENGTHS)], DECODE_LENGTHS
        rows.insert(2, (-1, 5))
    else:
        rows, lengths = [(0, m) for m in range(5, 5 + s["chunk"])] + [(-1, 3)] * 2, [5 + s["chunk"]]
    first = [min(m for rr, m in rows if rr == r) for r in range(len(lengths))]
    win = PagedHost.covering(rng, list(zip(first, lengths)), WINDOW_PER_PAGE, *entry_layout(dtype, hd, rd), s["pad"],
                             fill_ff)
    before = win.pool.copy()
    q_store, _ = rounded(rng.standard_normal((len(rows), s["heads"], hd)), dtype)
    kv_store, kv_raw = rounded(rng.standard_normal((len(rows), hd)) * np.exp(rng.uniform(-3, 3, (len(rows), 1))),
                               dtype)
    weight = (1 + 0.3 * rng.standard_normal(hd)).astype(np.float32)
    freq = inv_freq(rd, 4)
    fusion3(rt, dev, dtype, s, rows, q_store, kv_store, weight, freq, win)

    real = [i for i, (r, _) in enumerate(rows) if r >= 0]
    ref = reference_kv(kv_raw[real], weight, [rows[i][1] for i in real], freq)
    nope_amb, rope_amb = check_entries(dtype, window_rows(win, rows), ref, rd, bound(ref, QKV_ERR))
    assert nope_amb < 0.01 and rope_amb < 0.05, (nope_amb, rope_amb)
    written = np.zeros(win.pool.size, bool)
    for r, m in (row for row in rows if row[0] >= 0):
        o = win.offset(r, m)
        written[o:o + win.width * win.dtype.itemsize] = True
    assert np.array_equal(win.pool[~written], before[~written]), "fusion 3 wrote outside its entries"


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", SIZES)
def test_fusion3_exact_cases(rt, dev, size, dtype):
    """kv rows of ±1 have mean square 1, so with eps 0 both sides normalise exactly and the weight sets each
    nope value (sign from the row): the designed blocks, every pattern in every block position over the shifts."""
    s = SIZES[size]
    hd, rd = s["hd"], s["rd"]
    rng = np.random.default_rng([len(size), int(dtype == BF16)])
    rows = [(r, n - 1) for r, n in enumerate(DECODE_LENGTHS)] + [(-1, 5)]
    for shift in range(len(PATTERNS)):
        win = entry_host(rng, [np.ones(n // WINDOW_PER_PAGE + 1, bool) for n in DECODE_LENGTHS], WINDOW_PER_PAGE,
                         dtype, hd, rd, s["pad"])
        weight = np.concatenate([designed_nope(hd - rd, shift), rng.standard_normal(rd)]).astype(np.float32)
        x = rng.choice(np.float32([-1, 1]), (len(rows), hd))
        q_store, _ = rounded(rng.standard_normal((len(rows), s["heads"], hd)), dtype)
        freq = inv_freq(rd, 128)
        fusion3(rt, dev, dtype, s, rows, q_store, x.astype(dtype), weight, freq, win, eps=0.0)
        ref = reference_kv(x[:-1], weight, [m for _, m in rows[:-1]], freq, eps=0.0)
        delta = bound(ref, QKV_ERR)
        delta[:, :hd - rd] = 0
        check_entries(dtype, window_rows(win, rows), ref, rd, delta, exact=True)


# ---------------------------------------------------------------- compress_pool

def pool_run(rt, dev, dtype, case, lengths, a, z, ape, norm, eps, rng):
    """One compress_pool launch with fp8 entries over requests of `lengths` tokens from position 0 (a pad row
    between and after them); a, z [sum(lengths), c·width]. Returns the entries as stored (one more per request
    than it completes, which must stay untouched) and the numpy reference's entries."""
    from dsv4rt.model.compress import compress_pool
    width, rd, ratio = POOL_CASES[case]
    overlap, freq = ratio == 4, inv_freq(rd, ratio)
    c = 2 if overlap else 1
    counts = [n // ratio for n in lengths]
    per_page = 256 // ratio
    out = entry_host(rng, [np.ones(n // per_page + 1, bool) for n in counts], per_page, dtype, width, rd, 16)
    pos, req, a_rows, z_rows, at = [], [], [], [], 0
    for r, n in enumerate(lengths):
        pos += [*range(n), ratio - 1]
        req += [r] * n + [-1]
        a_rows += [a[at:at + n], np.full((1, c * width), np.nan, np.float32)]
        z_rows += [z[at:at + n], np.full((1, c * width), np.nan, np.float32)]
        at += n
    state_bytes, state_page = 2 * c * width * 4, max(lengths)
    state = dev(np.zeros(len(lengths) * state_page * state_bytes, np.uint8))
    state_cache = PagedCache(state.ptr, dev(np.arange(len(lengths), dtype=np.int64) * state_page * state_bytes).ptr,
                             dev(np.arange(len(lengths), dtype=np.int32)).ptr, state_page, state_bytes)
    pool, cache = out.upload(dev)
    compress_pool(rt.device, dtype, cache, state_cache, dev(np.vstack(a_rows)).ptr, dev(np.vstack(z_rows)).ptr,
                  dev(ape).ptr, dev(norm).ptr, dev(freq).ptr, dev(np.array(pos, np.int32)).ptr,
                  dev(np.array(req, np.int32)).ptr, rows=len(pos), width=width, ratio=ratio, overlap=overlap,
                  rope_dim=rd, eps=eps, fp8_kv=True)(rt.stream)
    rt.stream.synchronize()
    pool.copy_to_host(out.pool)

    eye, zero = np.eye(c * width, dtype=np.float32), np.zeros((c * width, c * width), np.float32)
    comp = Compressor(np.hstack([eye, zero]), np.hstack([zero, eye]), ape, norm, ratio, eps, Rope(freq))
    got, ref, at = [], [], 0
    for r, n in enumerate(lengths):
        st = comp.new_state()
        comp.update(st, np.hstack([a[at:at + n], z[at:at + n]]).astype(np.float64), np.arange(n))
        at += n
        got.append(np.array([out.entry(r, j) for j in range(counts[r] + 1)]))
        ref.append(st.entries)
    return got, ref


def check_untouched_tail(got):
    for g in got:
        assert np.all(g[-1].view(np.uint8) == 0xFF), "an entry not complete yet was written"


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", POOL_CASES)
def test_compress_entries(rt, dev, case, dtype):
    """Two requests in one launch: a long one and one whose only entry is its first."""
    width, rd, ratio = POOL_CASES[case]
    c = 2 if ratio == 4 else 1
    rng = np.random.default_rng([len(case), int(dtype == BF16)])
    lengths = [1000 if ratio == 4 else 3 * ratio + 5, ratio + 3]
    a = rng.standard_normal((sum(lengths), c * width), dtype=np.float32)
    z = 2 * rng.standard_normal((sum(lengths), c * width), dtype=np.float32)
    ape = rng.standard_normal((ratio, c * width), dtype=np.float32)
    norm = (1 + 0.2 * rng.standard_normal(width)).astype(np.float32)
    got, ref = pool_run(rt, dev, dtype, case, lengths, a, z, ape, norm, EPS, rng)
    check_untouched_tail(got)
    g, e = np.concatenate([x[:-1] for x in got]), np.concatenate(ref)
    nope_amb, rope_amb = check_entries(dtype, g, e, rd, bound(e, POOL_ERR))
    assert nope_amb < 0.03 and rope_amb < 0.15, (nope_amb, rope_amb)


def one_hot_scores(rng, n_tokens: int, width: int, ratio: int) -> np.ndarray:
    """z of -1000 but a 0 at one candidate of every (entry, channel): each entry pools exactly one a."""
    overlap = ratio == 4
    z = np.full((n_tokens, (1 + overlap) * width), -1000, np.float32)
    for j in range(n_tokens // ratio):
        tokens = ratio * j + np.arange(ratio)
        cols = np.full(ratio, width if overlap else 0)
        if overlap and j > 0:  # the previous window's first half; entry 0 has none
            tokens, cols = np.concatenate([tokens, tokens - ratio]), np.concatenate([cols, np.zeros(ratio, int)])
        pick = rng.integers(0, len(tokens), width)
        z[tokens[pick], cols[pick] + np.arange(width)] = 0
    return z


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["c4a", "c128a", "tiny"])
def test_compress_exact_cases(rt, dev, case, dtype):
    """Each entry pools one a of ±1 per channel (softmax weights exactly 1 and 0), so with eps 0 its mean
    square is 1 and the norm weight sets each nope value: the designed blocks, byte for byte."""
    width, rd, ratio = POOL_CASES[case]
    c = 2 if ratio == 4 else 1
    rng = np.random.default_rng([len(case), int(dtype == BF16)])
    lengths = [8 * ratio + 1, ratio]
    for shift in range(len(PATTERNS)):
        a = rng.choice(np.float32([-1, 1]), (sum(lengths), c * width))
        z = np.vstack([one_hot_scores(rng, n, width, ratio) for n in lengths])
        norm = np.concatenate([designed_nope(width - rd, shift), rng.standard_normal(rd)]).astype(np.float32)
        got, ref = pool_run(rt, dev, dtype, case, lengths, a, z, np.zeros((ratio, c * width), np.float32), norm,
                            0.0, rng)
        check_untouched_tail(got)
        e = np.concatenate(ref)
        delta = bound(e, QKV_ERR)
        delta[:, :width - rd] = 0
        check_entries(dtype, np.concatenate([x[:-1] for x in got]), e, rd, delta, exact=True)


# ---------------------------------------------------------------- attention over fp8 entries

def attend(rt, dev, dtype, s, ratio, q_ptr, rows, win, cmp, selected, sink, freq, splits) -> np.ndarray:
    from dsv4rt.model.attention import attention_workspace_bytes, sparse_attention
    n, heads, hd = len(rows), s["heads"], s["hd"]
    out = dev(np.full((n, heads, hd), np.nan, dtype))
    work = dev(np.zeros(max(attention_workspace_bytes(n, heads, hd, splits), 16), np.uint8))
    sparse_attention(rt.device, dtype, out.ptr, q_ptr, dev(np.array([m for _, m in rows], np.int32)).ptr,
                     dev(np.array([r for r, _ in rows], np.int32)).ptr, dev(sink).ptr, dev(freq).ptr, win, cmp,
                     selected, rows=n, heads=heads, head_dim=hd, rope_dim=s["rd"], window_size=s["window"],
                     ratio=ratio, top_k=s["top_k"] if selected else 0, splits=splits,
                     workspace=work.ptr if splits > 1 else 0, fp8_kv=True)(rt.stream)
    rt.stream.synchronize()
    return out.copy_to_host(np.empty((n, heads, hd), dtype)).astype(np.float32)


def check_attention(got, ref, rows, dtype):
    """float32: within 1e-5 of each row. bf16: each value is the reference's rounded to bf16, up to float32
    noise (1e-5 of the row's rms) that may tip a value at a rounding midpoint by one ulp. (A row-norm bound of
    1e-3 against the rounded reference fails on one such tip where head_dim is 32 or 96.)"""
    real = np.array([r >= 0 for r, _ in rows])
    assert np.all(got[~real] == 0), "padded rows must be zeros"
    got, ref = got[real], ref[real].astype(np.float64)
    if dtype == np.float32:
        assert rel_rows(got, ref).max() < 1e-5
        return
    half_ulp = np.ldexp(1.0, np.frexp(np.abs(ref))[1] - 9)  # bf16 keeps 8 significant bits
    noise = 1e-5 * np.sqrt(np.mean(np.square(ref), axis=-1, keepdims=True))
    assert np.all(np.abs(got - ref) <= half_ulp + noise), np.abs(got - ref).max()
    assert rel_rows(got, ref).max() < 4e-3


def faithful_caches(rng, dtype, s, ratio, cmp_per_page, rows, lengths, filled, mode):
    hd, rd, pad = s["hd"], s["rd"], s["pad"]
    win, win_keys = faithful_copy(rng, *window_cache(rng, np.float32, hd, pad, s["window"], rows, lengths, filled),
                                  dtype, rd, pad)
    cmp = cmp_keys = chosen = selected = None
    if ratio:
        host, keys, chosen, selected = compressed_cache(rng, np.float32, hd, pad, ratio, cmp_per_page, rows, lengths,
                                                        s["top_k"], mode == "c4a")
        cmp, cmp_keys = faithful_copy(rng, host, keys, dtype, rd, pad)
    return win, win_keys, cmp, cmp_keys, chosen, selected


@gpu
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", SIZES)
def test_decode_attention(rt, dev, size, dtype, mode, splits):
    s = SIZES[size]
    ratio, cmp_per_page = MODES[mode]
    rng = np.random.default_rng([len(size), len(mode), splits, int(dtype == BF16)])
    rows = [(r, n - 1) for r, n in enumerate(DECODE_LENGTHS)]
    rows.insert(3, (-1, PADDING_POSITION))
    win, win_keys, cmp, cmp_keys, chosen, selected = faithful_caches(rng, dtype, s, ratio, cmp_per_page, rows,
                                                                     DECODE_LENGTHS, DECODE_LENGTHS, mode)
    q_store, q = rounded(2 * rng.standard_normal((len(rows), s["heads"], s["hd"])), dtype)
    sink = (2 * rng.standard_normal(s["heads"])).astype(np.float32)
    freq = inv_freq(s["rd"], ratio)
    got = attend(rt, dev, dtype, s, ratio, dev(q_store).ptr, rows, win.upload(dev)[1],
                 cmp.upload(dev)[1] if cmp else None, dev(selected).ptr if selected is not None else None, sink,
                 freq, splits)
    check_attention(got, reference_attention(q, rows, win_keys, cmp_keys, chosen, sink, freq, s["window"], ratio),
                    rows, dtype)


@gpu
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", SIZES)
def test_prefill_chunk_attention(rt, dev, size, dtype, mode, splits):
    """Fusion 3 stores a chunk's kv among older fp8 window entries, then attention reads them all."""
    s = SIZES[size]
    ratio, cmp_per_page = MODES[mode]
    hd, rd, n, start = s["hd"], s["rd"], s["chunk"], 130
    rng = np.random.default_rng([len(size), len(mode), splits, int(dtype == BF16)])
    rows = [(0, m) for m in range(start, start + n)] + [(-1, PADDING_POSITION)] * 2
    win, win_keys, cmp, cmp_keys, chosen, selected = faithful_caches(rng, dtype, s, ratio, cmp_per_page, rows,
                                                                     [start + n], [start], mode)
    q_store, _ = rounded(3 * rng.standard_normal((len(rows), s["heads"], hd)), dtype)
    kv_store, kv_raw = rounded(rng.standard_normal((len(rows), hd)) + 0.5, dtype)
    weight = (1 + 0.3 * rng.standard_normal(hd)).astype(np.float32)
    sink = (2 * rng.standard_normal(s["heads"])).astype(np.float32)
    freq = inv_freq(rd, ratio)
    q_dev, win_dev = fusion3(rt, dev, dtype, s, rows, q_store, kv_store, weight, freq, win)

    written = window_rows(win, rows)
    ref_kv = reference_kv(kv_raw[:n], weight, np.arange(start, start + n), freq)
    check_entries(dtype, written, ref_kv, rd, bound(ref_kv, QKV_ERR))
    win_keys[0][start:start + n] = stored_values(dtype, written, hd, rd)
    q = q_dev.copy_to_host(np.empty_like(q_store)).astype(np.float32)
    got = attend(rt, dev, dtype, s, ratio, q_dev.ptr, rows, win_dev, cmp.upload(dev)[1] if cmp else None,
                 dev(selected).ptr if selected is not None else None, sink, freq, splits)
    check_attention(got, reference_attention(q, rows, win_keys, cmp_keys, chosen, sink, freq, s["window"], ratio),
                    rows, dtype)


# ---------------------------------------------------------------- host side (no GPU)

@pytest.mark.parametrize("hd, rd", [(512, 64), (32, 16), (96, 32), (128, 64)])
def test_entry_bytes(hd, rd):
    assert kv_entry_bytes(BF16, hd, rd, True) == layouts.kv_entry_bytes(hd, rd)
    assert kv_entry_bytes(np.float32, hd, rd, True) == kv_entry_bytes(np.float32, hd, rd) == 4 * hd
    assert kv_entry_bytes(BF16, hd, rd) == 2 * hd
    assert packed_kv(BF16, True) and not packed_kv(np.float32, True) and not packed_kv(BF16, False)


def test_bf16_entries_match_the_plan():
    cfg = ModelConfig.load(FIXTURES / "configs" / "deepseek-v4-flash.json")
    assert kv_entry_bytes(BF16, cfg.head_dim, cfg.rope_dim, True) == main_entry_bytes(cfg, "faithful") == 584


def test_launchers_reject_what_the_fp8_kernels_cannot_store():
    from dsv4rt.model.attention import qkv_norm_rope_insert, sparse_attention
    from dsv4rt.model.compress import compress_pool

    def qkv(dtype, hd, rd, entry_bytes):
        qkv_norm_rope_insert(None, dtype, 256, 256, 256, 0, 0, 0, PagedCache(256, 0, 0, 64, entry_bytes), rows=1,
                             heads=1, head_dim=hd, rope_dim=rd, eps=EPS, fp8_kv=True)

    def pool(dtype, width, rd, entry_bytes):
        compress_pool(None, dtype, PagedCache(256, 0, 0, 64, entry_bytes), PagedCache(256, 0, 0, 8, 1 << 16), 0, 0,
                      0, 0, 0, 0, 0, rows=0, width=width, ratio=4, overlap=True, rope_dim=rd, eps=EPS, fp8_kv=True)

    for bad in [(BF16, 512, 60, 584), (BF16, 512, 64, 576), (BF16, 512, 64, 588), (np.float32, 512, 64, 584)]:
        with pytest.raises(ValueError):
            qkv(*bad)
        with pytest.raises(ValueError):
            pool(*bad)
    with pytest.raises(ValueError):
        pool(BF16, 640, 64, 2048)
    with pytest.raises(ValueError):
        sparse_attention(None, BF16, 256, 256, 0, 0, 0, 0, PagedCache(256, 0, 0, 64, 2 * 584), rows=1, heads=8,
                         head_dim=512, rope_dim=64, window_size=128,
                         compressed=PagedCache(256, 0, 0, 64, 580), ratio=4, fp8_kv=True)
    pool(BF16, 512, 64, 584)      # what a faithful bf16 cache holds: accepted (no rows, no launch)
    pool(np.float32, 512, 64, 2048)
