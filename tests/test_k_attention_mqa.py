"""sparse_attention_mqa (attention_mqa.cu), the bf16 build's tensor-core sparse attention, against the numpy
reference and against sparse_attention on the same paged caches."""
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from conftest import rel_rows
from test_k_attention import (DECODE_LENGTHS, MODES, PADDING_POSITION, SIZES, PagedHost, compressed_cache, inv_freq,
                              nan_poison, reference_attention, rounded, window_cache)
from dsv4rt.model.attention import (attention_mqa_shared_bytes, attention_mqa_splits, attention_wgmma_shared_bytes,
                                    attention_workspace_bytes, sparse_attention, sparse_attention_mqa, wgmma_attention)
from dsv4rt.model.paged import PagedCache
from dsv4rt.reference.attention import Attention
from dsv4rt.reference.ops import Rope

gpu = pytest.mark.gpu
BF16 = ml_dtypes.bfloat16
SIZES = {**SIZES,  # flash 64 heads × 512, tiny 4 × 32, odd 6 × 96; "small" ones: heads not a multiple of 16
         "small-h20-d64": dict(heads=20, hd=64, rd=32, window=24, top_k=7, pad=0, chunk=45),
         "small-h40-d128": dict(heads=40, hd=128, rd=64, window=40, top_k=33, pad=16, chunk=70),
         "small-h72-d192": dict(heads=72, hd=192, rd=64, window=33, top_k=40, pad=0, chunk=50),  # 2 head blocks
         "flash-h80": dict(heads=80, hd=512, rd=64, window=128, top_k=512, pad=16, chunk=133)}  # wgmma: 64 + 16
SPLITS = [1, 3, 64]  # 64: more splits than key tiles, so that some blocks hold no key
MAX_SHARED = 227 * 1024  # an H100/H200 block's dynamic shared memory at most


def attend(rt, dev, launcher, s, ratio, q_ptr, rows, win, cmp, selected, sink, freq, splits, fp8_kv=False):
    """out [rows, heads, hd] as float32 from `launcher` (sparse_attention_mqa or sparse_attention), bf16 build."""
    n, heads, hd = len(rows), s["heads"], s["hd"]
    out = dev(np.full((n, heads, hd), np.nan, BF16))
    work = dev(np.full(max(attention_workspace_bytes(n, heads, hd, splits), 16), 0xFF, np.uint8))  # NaN partials
    launcher(rt.device, BF16, out.ptr, q_ptr, dev(np.array([m for _, m in rows], np.int32)).ptr,
             dev(np.array([r for r, _ in rows], np.int32)).ptr, dev(sink).ptr, dev(freq).ptr, win, cmp, selected,
             rows=n, heads=heads, head_dim=hd, rope_dim=s["rd"], window_size=s["window"], ratio=ratio,
             top_k=s["top_k"] if selected else 0, splits=splits, workspace=work.ptr if splits > 1 else 0,
             fp8_kv=fp8_kv)(rt.stream)
    rt.stream.synchronize()
    return out.copy_to_host(np.empty((n, heads, hd), BF16)).astype(np.float32)


def check(got, ref, rows, old=None):
    """bf16 within 1e-2 of the reference per (row, head), as sparse_attention's bf16 tests; heads whose
    reference is zero (padded rows, no key present) exactly zero; within 1e-2 of sparse_attention (old)."""
    real = np.array([r >= 0 for r, _ in rows])
    assert np.all(got[~real] == 0), "padded rows must be zeros"
    zero = ~np.any(ref, axis=-1) & real[:, None]
    assert np.all(got[zero] == 0), "a head without keys must be zeros"
    live = real[:, None] & ~zero
    assert rel_rows(got[live], ref[live]).max() < 1e-2
    if old is not None:
        assert rel_rows(got[live], old[live]).max() < 1e-2


def decode_case(rng, s, mode, dtype=BF16):
    ratio, cmp_per_page = MODES[mode]
    rows = [(r, n - 1) for r, n in enumerate(DECODE_LENGTHS)]
    rows.insert(3, (-1, PADDING_POSITION))
    win, win_keys = window_cache(rng, dtype, s["hd"], s["pad"], s["window"], rows, DECODE_LENGTHS, DECODE_LENGTHS)
    cmp = cmp_keys = chosen = selected = None
    if ratio:
        cmp, cmp_keys, chosen, selected = compressed_cache(rng, dtype, s["hd"], s["pad"], ratio, cmp_per_page, rows,
                                                           DECODE_LENGTHS, s["top_k"], mode == "c4a")
    q_store, q = rounded(2 * rng.standard_normal((len(rows), s["heads"], s["hd"])), BF16)
    sink = (2 * rng.standard_normal(s["heads"])).astype(np.float32)
    freq = inv_freq(s["rd"], ratio)
    ref = reference_attention(q, rows, win_keys, cmp_keys, chosen, sink, freq, s["window"], ratio)
    return rows, win, cmp, selected, q_store, sink, freq, ref


@gpu
@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("size", SIZES)
def test_decode_matches_reference_and_sparse_attention(rt, dev, size, mode, splits):
    s = SIZES[size]
    ratio = MODES[mode][0]
    rng = np.random.default_rng([len(size), len(mode), splits])
    rows, win, cmp, selected, q_store, sink, freq, ref = decode_case(rng, s, mode)
    args = (s, ratio, dev(q_store).ptr, rows, win.upload(dev)[1], cmp.upload(dev)[1] if cmp else None,
            dev(selected).ptr if selected is not None else None, sink, freq, splits)
    check(attend(rt, dev, sparse_attention_mqa, *args), ref, rows, attend(rt, dev, sparse_attention, *args))


@gpu
@pytest.mark.parametrize("start", [0, 300])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("size", SIZES)
def test_prefill_chunk_matches_reference(rt, dev, size, mode, start):
    """Consecutive rows of one request (each sees one more window entry and compressed entries as they become
    visible), then two padded rows; split in two at start 300."""
    s = SIZES[size]
    ratio, cmp_per_page = MODES[mode]
    rng = np.random.default_rng([len(size), len(mode), start])
    end = start + s["chunk"]
    rows = [(0, m) for m in range(start, end)] + [(-1, PADDING_POSITION)] * 2
    win, win_keys = window_cache(rng, BF16, s["hd"], s["pad"], s["window"], rows, [end], [end])
    cmp = cmp_keys = chosen = selected = None
    if ratio:
        cmp, cmp_keys, chosen, selected = compressed_cache(rng, BF16, s["hd"], s["pad"], ratio, cmp_per_page, rows,
                                                           [end], s["top_k"], mode == "c4a")
    q_store, q = rounded(3 * rng.standard_normal((len(rows), s["heads"], s["hd"])), BF16)
    sink = (2 * rng.standard_normal(s["heads"])).astype(np.float32)
    freq = inv_freq(s["rd"], ratio)
    got = attend(rt, dev, sparse_attention_mqa, s, ratio, dev(q_store).ptr, rows, win.upload(dev)[1],
                 cmp.upload(dev)[1] if cmp else None, dev(selected).ptr if selected is not None else None, sink, freq,
                 2 if start else 1)
    check(got, reference_attention(q, rows, win_keys, cmp_keys, chosen, sink, freq, s["window"], ratio), rows)


def holey_cache(rng, lengths, per_page, s, empty):
    """Caches whose pages are held at random (none for request `empty`); float32 keys, NaN where absent."""
    held = [rng.random(max(n - 1, 0) // per_page + 2) < 0.6 for n in lengths]
    held[empty][:] = False
    cache = PagedHost(rng, held, per_page, s["hd"], BF16, s["pad"], nan_poison(BF16))
    keys = [np.full((n, s["hd"]), np.nan, np.float32) for n in lengths]
    for r, n in enumerate(lengths):
        for e in np.flatnonzero(np.repeat(held[r], per_page)[:n]):
            stored, keys[r][e] = rounded(rng.standard_normal(s["hd"]), BF16)
            cache.entry(r, e)[:] = stored
    return cache, keys


@gpu
@pytest.mark.parametrize("chosen", [False, True])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("size", ["flash", "flash-h80", "tiny", "odd"])
def test_absent_keys_and_pages(rt, dev, size, splits, chosen):
    """Pages not held anywhere in the window and compressed caches; selections of -1, of entries not yet
    visible and of entries on pages not held: all absent keys. Request 2 holds no page (zeros)."""
    s = SIZES[size]
    ratio, per_page = 4, 8
    rng = np.random.default_rng([len(size), splits, chosen])
    lengths = [300, 41, 6]
    rows = [(0, 299), (0, 150), (1, 40), (-1, PADDING_POSITION), (2, 5), (0, 9)]
    win, win_keys = holey_cache(rng, lengths, per_page, s, 2)
    cmp, cmp_keys = holey_cache(rng, [n // ratio for n in lengths], per_page, s, 2)
    selected = np.full((len(rows), s["top_k"]), -1, np.int32)
    for t, (r, m) in enumerate(rows):
        n, visible = (len(cmp_keys[r]), (m + 1) // ratio) if r >= 0 else (0, 0)
        pick = rng.choice(n, min(n, s["top_k"] - 1), replace=False)  # some past `visible`
        selected[t, :len(pick)] = pick
        selected[t] = rng.permutation(selected[t])
    q_store, q = rounded(2 * rng.standard_normal((len(rows), s["heads"], s["hd"])), BF16)
    sink = (2 * rng.standard_normal(s["heads"])).astype(np.float32)
    freq = inv_freq(s["rd"], ratio)

    ref = np.zeros_like(q)
    for t, (r, m) in enumerate(rows):
        if r < 0:
            continue
        visible = (m + 1) // ratio
        entries = selected[t] if chosen else np.arange(visible)
        cmp_rows = [cmp_keys[r][e] if 0 <= e < visible else np.full(s["hd"], np.nan) for e in entries]
        keys = np.concatenate([win_keys[r][max(0, m - s["window"] + 1):m + 1], np.reshape(cmp_rows, (-1, s["hd"]))])
        mask = np.isfinite(keys).all(axis=1)
        o = Attention._attend(SimpleNamespace(sink=sink), q[t:t + 1], np.where(mask[:, None], keys, 0), mask[None])
        ref[t] = Rope(freq)(o, np.array([m]), inverse=True)[0]
    args = (s, ratio, dev(q_store).ptr, rows, win.upload(dev)[1], cmp.upload(dev)[1],
            dev(selected).ptr if chosen else None, sink, freq, splits)
    got = attend(rt, dev, sparse_attention_mqa, *args)
    assert np.all(got[4] == 0), "a request without a held page gets zeros"
    check(got, ref, rows, attend(rt, dev, sparse_attention, *args))


@gpu
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("size", ["flash", "flash-h80", "tiny", "odd"])
def test_fp8_entries_match_reference_and_sparse_attention(rt, dev, size, mode, splits):
    """Faithful-mode 584-byte entries (at Flash sizes), dequantised into the shared-memory tiles."""
    from test_k_kv_fp8 import faithful_caches
    s = SIZES[size]
    ratio, cmp_per_page = MODES[mode]
    rng = np.random.default_rng([len(size), len(mode), splits, 8])
    rows = [(r, n - 1) for r, n in enumerate(DECODE_LENGTHS)]
    rows.insert(3, (-1, PADDING_POSITION))
    win, win_keys, cmp, cmp_keys, chosen, selected = faithful_caches(rng, BF16, s, ratio, cmp_per_page, rows,
                                                                     DECODE_LENGTHS, DECODE_LENGTHS, mode)
    q_store, q = rounded(2 * rng.standard_normal((len(rows), s["heads"], s["hd"])), BF16)
    sink = (2 * rng.standard_normal(s["heads"])).astype(np.float32)
    freq = inv_freq(s["rd"], ratio)
    args = (s, ratio, dev(q_store).ptr, rows, win.upload(dev)[1], cmp.upload(dev)[1] if cmp else None,
            dev(selected).ptr if selected is not None else None, sink, freq, splits)
    check(attend(rt, dev, sparse_attention_mqa, *args, fp8_kv=True),
          reference_attention(q, rows, win_keys, cmp_keys, chosen, sink, freq, s["window"], ratio), rows,
          attend(rt, dev, sparse_attention, *args, fp8_kv=True))


@gpu
def test_graph_replays_on_new_rows(rt, dev):
    """The launch depends on shapes only: a graph captured once serves new positions, selections and q."""
    from dsv4rt.cuda.device import Graph
    s, mode = SIZES["flash"], "c4a"
    ratio = MODES[mode][0]
    rng = np.random.default_rng(7)
    rows, win, cmp, selected, q_store, sink, freq, ref = decode_case(rng, s, mode)
    n = len(rows)
    splits = attention_mqa_splits(n, s["heads"], s["window"] + s["top_k"], rt.device.sm_count)
    out = dev(np.full((n, s["heads"], s["hd"]), np.nan, BF16))
    work = dev(np.zeros(max(attention_workspace_bytes(n, s["heads"], s["hd"], splits), 16), np.uint8))
    positions, req = dev(np.zeros(n, np.int32)), dev(np.full(n, -1, np.int32))
    q_dev, sel_dev, sink_dev, freq_dev = dev(np.zeros_like(q_store)), dev(np.full_like(selected, -1)), dev(sink), \
        dev(freq)
    launch = sparse_attention_mqa(rt.device, BF16, out.ptr, q_dev.ptr, positions.ptr, req.ptr, sink_dev.ptr,
                                  freq_dev.ptr, win.upload(dev)[1], cmp.upload(dev)[1], sel_dev.ptr, rows=n,
                                  heads=s["heads"], head_dim=s["hd"], rope_dim=s["rd"], window_size=s["window"],
                                  ratio=ratio, top_k=s["top_k"], splits=splits, workspace=work.ptr)
    graph = Graph(rt.stream)
    with graph:
        launch(rt.stream)
    graph.replay()  # every row padded
    rt.stream.synchronize()
    assert not out.copy_to_host(np.empty((n, s["heads"], s["hd"]), BF16)).astype(np.float32).any()
    for buf, host in ((positions, np.array([m for _, m in rows], np.int32)),
                      (req, np.array([r for r, _ in rows], np.int32)), (q_dev, q_store), (sel_dev, selected)):
        buf.copy_from_host(host)
    graph.replay()
    rt.stream.synchronize()
    check(out.copy_to_host(np.empty((n, s["heads"], s["hd"]), BF16)).astype(np.float32), ref, rows)
    graph.close()


# ---------------------------------------------------------------- host side (no GPU)

def test_launcher_refuses_what_the_kernel_cannot_take():
    def launch(dtype=BF16, hd=512, rd=64, entry_bytes=1024, fp8_kv=False, rows=1, **kw):
        sparse_attention_mqa(None, dtype, 256, 256, 0, 0, 0, 0, PagedCache(256, 0, 0, 64, entry_bytes), rows=rows,
                             heads=64, head_dim=hd, rope_dim=rd, window_size=128, fp8_kv=fp8_kv, **kw)

    for bad in [dict(dtype=np.float32, entry_bytes=2048), dict(hd=504, entry_bytes=1008), dict(hd=88, rd=8),
                dict(entry_bytes=1000), dict(fp8_kv=True, entry_bytes=580), dict(fp8_kv=True, rd=60, entry_bytes=584),
                dict(splits=2), dict(ratio=4), dict(rows=0)]:
        with pytest.raises(ValueError):
            launch(**bad)


def test_splits_fill_one_wave_with_whole_tiles():
    assert attention_mqa_splits(1, 64, 640, 132) == 10            # 20 tiles of 32 keys, 2 per block
    assert attention_mqa_splits(1, 64, 640, 132, min_tiles=1) == 20
    assert attention_mqa_splits(8, 64, 640, 132) == 10
    assert attention_mqa_splits(64, 64, 640, 132) == 3            # ceil(132 / 64)
    assert attention_mqa_splits(1, 128, 640, 132) == 10           # two head blocks per row
    assert attention_mqa_splits(200, 64, 640, 132) == 1
    assert attention_mqa_splits(1, 64, 1, 132) == 1


@pytest.mark.parametrize("hd, rd", [(512, 64), (192, 64), (96, 32), (32, 16)])
def test_shared_memory_fits_a_block(hd, rd):
    assert max(attention_mqa_shared_bytes(BF16, hd, rd), attention_mqa_shared_bytes(BF16, hd, rd, True)) <= MAX_SHARED
    if hd == 512:  # q rows and two key tiles of 520 bf16 and 16 KB of swapped scores; fp8: one tile, two encoded
        assert attention_mqa_shared_bytes(BF16, hd, rd) == 96 * 1040 + 32 * 1040 + 16384
        assert attention_mqa_shared_bytes(BF16, hd, rd, True) == 96 * 1040 + 2 * 32 * 584 + 16384


def test_wgmma_takes_hopper_rows_of_512_dims_without_splits():
    assert wgmma_attention("sm_90a", 512, 1)
    assert not wgmma_attention("sm_90a", 512, 3)   # split rows stay on attention_mqa.cu and its merge
    assert not wgmma_attention("sm_90a", 192, 1)
    assert not wgmma_attention("sm_89", 512, 1)


def test_wgmma_shared_memory_fits_a_block():
    # alignment, q, two key tiles of 64 keys (fp8: one, and two encoded), P, row statistics
    assert attention_wgmma_shared_bytes(512, 64, False) == 1024 + 65536 + 2 * 65536 + 8192 + 512 <= MAX_SHARED
    assert attention_wgmma_shared_bytes(512, 64, True) == 1024 + 65536 + 65536 + 2 * 64 * 584 + 8192 + 512 <= MAX_SHARED
