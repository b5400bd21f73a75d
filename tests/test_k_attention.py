"""Fusion 3 (qkv.cu) and sparse attention (attention.cu) against the numpy reference, on paged caches."""
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from conftest import rel_rows
from dsv4rt.reference.attention import Attention
from dsv4rt.reference.ops import Rope, rmsnorm

pytestmark = pytest.mark.gpu
BF16 = ml_dtypes.bfloat16
EPS = 1e-6
WINDOW_PER_PAGE = 64
SIZES = {  # pad: bytes after each cache entry, so that the entry stride differs from the row size
    "flash": dict(heads=64, hd=512, rd=64, window=128, top_k=512, pad=0, chunk=133),
    "tiny": dict(heads=4, hd=32, rd=16, window=16, top_k=8, pad=0, chunk=37),
    "odd": dict(heads=6, hd=96, rd=32, window=20, top_k=5, pad=16, chunk=29),
}
MODES = {"sliding": (0, 0), "c128a": (128, 2), "c4a": (4, 64)}  # ratio, compressed entries per page
DECODE_LENGTHS = [1, 3, 127, 128, 129, 1000, 4, 2600]
PADDING_POSITION = 77777  # a padded row's position is garbage


class PagedHost:
    """Requests' cache entries in pages at random slots of one pool (two slots nobody owns), like dsv4rt.kv
    hands them out. held[r][c]: whether logical page c of request r has a page; -1 in the table if not."""

    def __init__(self, rng, held, per_page: int, width: int, dtype, pad: int, poison):
        self.per_page, self.width, self.dtype = per_page, width, np.dtype(dtype)
        self.entry_bytes = width * self.dtype.itemsize + pad
        page_bytes = -(-per_page * self.entry_bytes // 16) * 16
        slots = iter(rng.permutation(sum(int(h.sum()) for h in held) + 2))
        self.pool = np.empty((sum(int(h.sum()) for h in held) + 2) * page_bytes, np.uint8)
        poison(self.pool)
        pages, starts = [], []
        for h in held:
            starts.append(len(pages))
            pages += [next(slots) * page_bytes if on else -1 for on in h]
        self.pages, self.page_start = np.array(pages, np.int64), np.array(starts, np.int32)

    @classmethod
    def covering(cls, rng, spans, per_page, width, dtype, pad, poison):
        """spans[r] = (first, end): the entries of request r that must lie in held pages; one unheld column follows."""
        held = []
        for first, end in spans:
            h = np.zeros(max(end - 1, 0) // per_page + 2, bool)
            if end > first:
                h[first // per_page:(end - 1) // per_page + 1] = True
            held.append(h)
        return cls(rng, held, per_page, width, dtype, pad, poison)

    def offset(self, r: int, e: int) -> int:
        page = self.pages[self.page_start[r] + e // self.per_page]
        assert page >= 0
        return int(page) + (e % self.per_page) * self.entry_bytes

    def entry(self, r: int, e: int) -> np.ndarray:
        o = self.offset(r, e)
        return self.pool[o:o + self.width * self.dtype.itemsize].view(self.dtype)

    def upload(self, dev):
        from dsv4rt.model.paged import PagedCache
        pool = dev(self.pool)
        return pool, PagedCache(pool.ptr, dev(self.pages).ptr, dev(self.page_start).ptr, self.per_page,
                                self.entry_bytes)


def nan_poison(dtype):
    def fill(pool):
        pool.view(dtype)[:] = np.nan
    return fill


def random_bytes(rng):
    def fill(pool):
        pool[:] = rng.integers(0, 256, pool.size, dtype=np.uint8)
    return fill


def inv_freq(rd: int, ratio: int) -> np.ndarray:
    base = 160000.0 if ratio else 10000.0
    return (base ** (-np.arange(0, rd, 2) / rd)).astype(np.float32)


def rounded(x, dtype) -> np.ndarray:
    """x in the storage type, and its float32 value that the reference sees."""
    s = np.asarray(x, np.float32).astype(dtype)
    return s, s.astype(np.float32)


def reference_attention(q, rows, win_keys, cmp_keys, chosen, sink, freq, window, ratio):
    """Reference output rows (padded rows: zeros) from float32 key arrays per request."""
    hd = q.shape[-1]
    out = np.zeros_like(q)
    for t, (r, m) in enumerate(rows):
        if r < 0:
            continue
        lo = max(0, m - window + 1)
        keys, mask = win_keys[r][lo:m + 1], np.ones(m + 1 - lo, bool)
        if ratio:
            n = len(cmp_keys[r])
            visible = (np.arange(n) < (m + 1) // ratio) & (chosen[t] if chosen is not None else True)
            keys, mask = np.concatenate([keys, cmp_keys[r]]), np.concatenate([mask, visible])
            keys = np.where(mask[:, None], keys, 0)  # the NaN poison of unread entries stays out of 0·NaN
        o = Attention._attend(SimpleNamespace(sink=sink), q[t:t + 1], keys.reshape(-1, hd), mask[None])
        out[t] = Rope(freq)(o, np.array([m]), inverse=True)[0]
    return out


def compressed_cache(rng, dtype, hd, pad, ratio, per_page, rows, lengths, top_k, selected_mode):
    """Compressed caches with every entry visible to some row; entries no row reads (past the visible
    ones, or chosen by no row in c4a mode) stay NaN. Returns the cache, float32 keys and the selection."""
    n_req = len(lengths)
    counts = [length // ratio for length in lengths]
    cache = PagedHost.covering(rng, [(0, n + 1) for n in counts], per_page, hd, dtype, pad, nan_poison(dtype))
    keys = [np.full((n, hd), np.nan, np.float32) for n in counts]
    chosen = selected = None
    read = [np.ones(n, bool) for n in counts]
    if selected_mode:
        selected = rng.integers(0, 1 << 20, (len(rows), top_k)).astype(np.int32)  # junk for padded rows
        chosen = []
        read = [np.zeros(n, bool) for n in counts]
        for t, (r, m) in enumerate(rows):
            visible = (m + 1) // ratio if r >= 0 else 0
            full = min(top_k, visible)
            n_valid = int(rng.integers(0, full + 1)) if t % 3 == 1 else full  # and sometimes fewer than visible
            pick = rng.choice(visible, n_valid, replace=False)
            if r >= 0 and n_valid < top_k and visible < counts[r]:  # a later row's entry: masked like the reference
                pick = np.append(pick, rng.integers(visible, counts[r]))
                n_valid += 1
            if r >= 0:
                selected[t] = rng.permutation(np.concatenate([pick, np.full(top_k - n_valid, -1)]))
                read[r][pick] = True
            mask = np.zeros(counts[r] if r >= 0 else 0, bool)
            mask[pick] = True
            chosen.append(mask)
    for r in range(n_req):
        for j in np.flatnonzero(read[r]):
            stored, keys[r][j] = rounded(rng.standard_normal(hd), dtype)
            cache.entry(r, j)[:] = stored
    return cache, keys, chosen, selected


def window_cache(rng, dtype, hd, pad, window, rows, lengths, filled):
    """Window caches holding the entries each request's rows read; entries below filled[r] get random kv,
    the others (and everything outside the window) stay NaN. Returns the cache and float32 keys."""
    first = [min([max(0, m - window + 1) for rr, m in rows if rr == r]) for r in range(len(lengths))]
    cache = PagedHost.covering(rng, list(zip(first, lengths)), WINDOW_PER_PAGE, hd, dtype, pad, nan_poison(dtype))
    keys = [np.full((n, hd), np.nan, np.float32) for n in lengths]
    for r, (a, b) in enumerate(zip(first, filled)):
        for e in range(a, b):
            stored, keys[r][e] = rounded(rng.standard_normal(hd), dtype)
            cache.entry(r, e)[:] = stored
    return cache, keys


def run_attention(rt, dev, dtype, s, ratio, q_ptr, rows, win, cmp, selected, sink, freq, splits):
    from dsv4rt.model.attention import attention_workspace_bytes, sparse_attention
    n, heads, hd = len(rows), s["heads"], s["hd"]
    positions = np.array([m for _, m in rows], np.int32)
    req = np.array([r for r, _ in rows], np.int32)
    out = dev(np.full((n, heads, hd), np.nan, dtype))
    work = dev(np.zeros(max(attention_workspace_bytes(n, heads, hd, splits), 16), np.uint8))
    launch = sparse_attention(
        rt.device, dtype, out.ptr, q_ptr, dev(positions).ptr,
        dev(req).ptr, dev(sink).ptr, dev(freq).ptr, win, cmp, selected, rows=n, heads=heads, head_dim=hd,
        rope_dim=s["rd"], window_size=s["window"], ratio=ratio, top_k=s["top_k"] if selected else 0,
        splits=splits, workspace=work.ptr if splits > 1 else 0)
    launch(rt.stream)
    rt.stream.synchronize()
    return out.copy_to_host(np.empty((n, heads, hd), dtype)).astype(np.float32)


def check(got, ref, rows, dtype):
    real = np.array([r >= 0 for r, _ in rows])
    assert np.all(got[~real] == 0), "padded rows must be zeros"
    err = rel_rows(got[real], ref[real]).max()
    assert err < (1e-5 if dtype == np.float32 else 1e-2), err


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [np.float32, BF16])
@pytest.mark.parametrize("size", SIZES)
def test_decode_matches_reference(rt, dev, size, dtype, mode, splits):
    s = SIZES[size]
    ratio, cmp_per_page = MODES[mode]
    rng = np.random.default_rng([len(size), len(mode), splits, int(dtype == BF16)])
    rows = [(r, n - 1) for r, n in enumerate(DECODE_LENGTHS)]
    rows.insert(3, (-1, PADDING_POSITION))
    win, win_keys = window_cache(rng, dtype, s["hd"], s["pad"], s["window"], rows, DECODE_LENGTHS, DECODE_LENGTHS)
    cmp = cmp_keys = chosen = selected = None
    if ratio:
        cmp, cmp_keys, chosen, selected = compressed_cache(rng, dtype, s["hd"], s["pad"], ratio, cmp_per_page, rows,
                                                           DECODE_LENGTHS, s["top_k"], mode == "c4a")
    q_dev, q = rounded(2 * rng.standard_normal((len(rows), s["heads"], s["hd"])), dtype)
    sink = (2 * rng.standard_normal(s["heads"])).astype(np.float32)
    freq = inv_freq(s["rd"], ratio)
    win_dev = win.upload(dev)[1]
    cmp_dev = cmp.upload(dev)[1] if cmp else None
    sel = dev(selected).ptr if selected is not None else None
    got = run_attention(rt, dev, dtype, s, ratio, dev(q_dev).ptr, rows, win_dev, cmp_dev, sel, sink, freq, splits)
    check(got, reference_attention(q, rows, win_keys, cmp_keys, chosen, sink, freq, s["window"], ratio), rows, dtype)


def fused_qkv(rt, dev, dtype, s, q_raw, kv_raw, weight, rows, freq, window_dev):
    from dsv4rt.model.attention import qkv_norm_rope_insert
    q = dev(q_raw)
    launch = qkv_norm_rope_insert(
        rt.device, dtype, q.ptr, dev(kv_raw).ptr, dev(weight).ptr, dev(np.array([m for _, m in rows], np.int32)).ptr,
        dev(np.array([r for r, _ in rows], np.int32)).ptr, dev(freq).ptr, window_dev, rows=len(rows),
        heads=s["heads"], head_dim=s["hd"], rope_dim=s["rd"], eps=EPS)
    launch(rt.stream)
    return q


def reference_qkv(q, kv, weight, positions, freq):
    rope = Rope(freq)
    return rope(rmsnorm(q, None, EPS), positions), rope(rmsnorm(kv, weight, EPS), positions)


@pytest.mark.parametrize("start", [0, 5, 126, 300])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [np.float32, BF16])
@pytest.mark.parametrize("size", SIZES)
def test_prefill_chunk_after_fusion3_matches_reference(rt, dev, size, dtype, mode, start):
    """A chunk of one request: fusion 3 inserts its kv among older window entries, then attention.
    Two padded rows close the chunk; one phase also runs split."""
    s = SIZES[size]
    ratio, cmp_per_page = MODES[mode]
    hd, heads, n = s["hd"], s["heads"], s["chunk"]
    rng = np.random.default_rng([len(size), len(mode), start, int(dtype == BF16)])
    end = start + n
    rows = [(0, m) for m in range(start, end)] + [(-1, PADDING_POSITION)] * 2
    win, win_keys = window_cache(rng, dtype, hd, s["pad"], s["window"], rows, [end], [start])
    cmp = cmp_keys = chosen = selected = None
    if ratio:
        cmp, cmp_keys, chosen, selected = compressed_cache(rng, dtype, hd, s["pad"], ratio, cmp_per_page, rows,
                                                           [end], s["top_k"], mode == "c4a")
    q_store, q_raw = rounded(3 * rng.standard_normal((len(rows), heads, hd)), dtype)
    kv_store, kv_raw = rounded(rng.standard_normal((len(rows), hd)) + 0.5, dtype)
    weight = (1 + 0.3 * rng.standard_normal(hd)).astype(np.float32)
    sink = (2 * rng.standard_normal(heads)).astype(np.float32)
    freq = inv_freq(s["rd"], ratio)
    _, win_dev = win.upload(dev)
    q_dev = fused_qkv(rt, dev, dtype, s, q_store, kv_store, weight, rows, freq, win_dev)
    cmp_dev = cmp.upload(dev)[1] if cmp else None
    sel = dev(selected).ptr if selected is not None else None
    got = run_attention(rt, dev, dtype, s, ratio, q_dev.ptr, rows, win_dev, cmp_dev, sel, sink, freq,
                        2 if start == 126 else 1)

    q_ref, kv_ref = reference_qkv(q_raw[:n], kv_raw[:n], weight, np.arange(start, end), freq)
    win_keys[0][start:end] = kv_ref
    q_all = np.zeros_like(q_raw)
    q_all[:n] = q_ref
    check(got, reference_attention(q_all, rows, win_keys, cmp_keys, chosen, sink, freq, s["window"], ratio),
          rows, dtype)


@pytest.mark.parametrize("layout", ["decode", "prefill"])
@pytest.mark.parametrize("dtype", [np.float32, BF16])
@pytest.mark.parametrize("size", SIZES)
def test_fusion3_matches_reference_and_writes_only_its_entries(rt, dev, size, dtype, layout):
    s = SIZES[size]
    hd, heads = s["hd"], s["heads"]
    rng = np.random.default_rng([len(size), len(layout), int(dtype == BF16)])
    if layout == "decode":
        rows = [(r, n - 1) for r, n in enumerate(DECODE_LENGTHS)]
        rows.insert(2, (-1, 5))
        lengths = DECODE_LENGTHS
    else:
        rows = [(0, m) for m in range(5, 5 + s["chunk"])] + [(-1, 3)] * 2
        lengths = [5 + s["chunk"]]
    first = [min([m for rr, m in rows if rr == r]) for r in range(len(lengths))]
    win = PagedHost.covering(rng, list(zip(first, lengths)), WINDOW_PER_PAGE, hd, dtype, s["pad"],
                             random_bytes(rng))
    before = win.pool.copy()
    q_store, q_raw = rounded(3 * rng.standard_normal((len(rows), heads, hd)), dtype)
    kv_store, kv_raw = rounded(rng.standard_normal((len(rows), hd)) - 0.7, dtype)
    weight = (1 + 0.3 * rng.standard_normal(hd)).astype(np.float32)
    freq = inv_freq(s["rd"], 4)
    pool_dev, win_dev = win.upload(dev)
    q_dev = fused_qkv(rt, dev, dtype, s, q_store, kv_store, weight, rows, freq, win_dev)
    rt.stream.synchronize()
    q = q_dev.copy_to_host(np.empty_like(q_store))
    pool_dev.copy_to_host(win.pool)

    real = np.array([r >= 0 for r, _ in rows])
    positions = np.array([m for _, m in rows])
    q_ref, kv_ref = reference_qkv(q_raw[real], kv_raw[real], weight, positions[real], freq)
    tol = 1e-5 if dtype == np.float32 else 1e-2
    assert rel_rows(q[real].astype(np.float32), q_ref).max() < tol
    assert np.array_equal(q[~real].view(np.uint8), q_store[~real].view(np.uint8)), "padded q rows are left alone"
    written = np.zeros(win.pool.size, bool)
    stored = []
    for r, m in (row for row in rows if row[0] >= 0):
        stored.append(win.entry(r, m).astype(np.float32))
        o = win.offset(r, m)
        written[o:o + hd * np.dtype(dtype).itemsize] = True
    assert rel_rows(np.array(stored), kv_ref).max() < tol
    assert np.array_equal(win.pool[~written], before[~written]), "fusion 3 wrote outside its entries"
