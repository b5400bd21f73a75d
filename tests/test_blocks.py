"""Block manager: tables per kind and layer, sliding kinds giving pages back, admission, release."""
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import FIXTURES, TINY_A
from dsv4rt.config import SLIDING, ModelConfig, from_dict
from dsv4rt.kv.blocks import BlockManager, OutOfPages
from dsv4rt.kv.plan import LARGE, MEDIUM, SMALL, build_plan
from dsv4rt.kv.slab import SlabAllocator

FLASH = ModelConfig.load(FIXTURES / "configs" / "deepseek-v4-flash.json")
TINY = ModelConfig.load(TINY_A)


def manager(cfg, slabs: int, slab_bytes: int = 2 << 20, numerics: str = "exact") -> BlockManager:
    plan = build_plan(cfg, numerics)
    return BlockManager(plan, SlabAllocator(slabs * slab_bytes, plan.class_page_bytes, slab_bytes))


def used(m: BlockManager) -> list[int]:
    return [m.allocator.stats(c).used_pages for c in range(3)]


def held_by_class(m: BlockManager, requests) -> list[int]:
    counts = [0, 0, 0]
    for r in requests:
        for k in m.plan.kinds:
            counts[k.size_class] += len(k.layers) * m.held_columns(r, k.name)
    return counts


def test_decode_one_token_at_a_time_gives_sliding_pages_back():
    m = manager(FLASH, slabs=64)
    seen = {}                                  # (kind, layer, column) -> page id: a held page never moves
    for n in range(1, 1001):
        m.place("r", n)
        assert used(m) == held_by_class(m, ["r"])
        for k in m.plan.kinds:
            assert m.held_columns("r", k.name) == sum(b - a for a, b in k.columns(n - 1, n)) <= k.pages(n)
            for layer in (k.layers[0], k.layers[-1]):
                for col, page in enumerate(m.table("r", k.name, layer)):
                    if page >= 0:
                        assert seen.setdefault((k.name, layer, col), page) == page
    # after the step computing token 999: window reads 872..998 (pages 13-15 of 64 tokens); the c4a
    # states hold 992..999 (page 124 of 8); the c128a state 896..999 (pages 56-62 of 16)
    held = {k.name: m.held_columns("r", k.name) for k in m.plan.kinds}
    assert held == dict(window=3, compressed_c4a=4, indexer=4, state_main_c4a=1, state_indexer=1,
                        compressed_c128a=4, state_c128a=7)
    window = m.table("r", "window", 0)
    assert len(window) == 16 and (window[:13] == -1).all() and (window[13:] >= 0).all()
    state = m.table("r", "state_c128a", 3)
    assert len(state) == 63 and (state[:56] == -1).all() and (state[56:] >= 0).all()
    assert (m.table("r", "compressed_c4a", 42) >= 0).all()
    assert used(m) == [43 * 3 + 21 * 4 + 21 * 1 + 20 * 7, 21 * 4 + 21 * 1, 20 * 4]
    m.release("r")
    assert used(m) == [0, 0, 0] and m.allocator.free_slabs == m.allocator.n_slabs and "r" not in m


def test_chunks_hold_what_the_step_reads_and_leaves_for_the_next():
    m = manager(FLASH, slabs=64)
    m.place("r", 512)
    assert m.held_columns("r", "window") == 2                    # leaves 385..511 for the next step
    m.place("r", 1024)
    # reads 385..511 (pages 6, 7), writes 897..1023 (pages 14, 15); 512..896 stay in the workspace
    window = m.table("r", "window", 5)
    assert [c for c, p in enumerate(window) if p >= 0] == [6, 7, 14, 15]
    assert [c for c, p in enumerate(m.table("r", "state_c128a", 3)) if p >= 0] == []   # 1024 closes a window
    m.place("r", 1100)
    assert [c for c, p in enumerate(m.table("r", "window", 5)) if p >= 0] == [14, 15, 16, 17]
    assert [c for c, p in enumerate(m.table("r", "state_c128a", 3)) if p >= 0] == [64, 65, 66, 67, 68]
    assert m.held_columns("r", "compressed_c128a") == 5
    assert used(m) == held_by_class(m, ["r"])
    m.release("r")
    assert used(m) == [0, 0, 0]


def test_admission_refuses_when_short_and_accepts_after_a_release():
    m = manager(TINY, slabs=20, slab_bytes=8192)    # tiny-a exact: 2 large, 4 medium, 8 small pages a slab
    m.place("a", 1000)
    before = used(m)
    assert before == [17, 10, 8]                    # 9 + 3 + 1 slabs
    assert m.fits_ever(1000, chunk=1) and not m.can_place("b", 1000)
    with pytest.raises(OutOfPages):
        m.place("b", 1000)
    assert used(m) == before and "b" not in m
    m.release("a")
    assert m.can_place("b", 1000)
    m.place("b", 1000)
    assert used(m) == before


def test_a_step_that_gives_back_as_much_as_it_takes_fits_a_full_pool():
    cfg = from_dict({**json.loads((TINY_A / "config.json").read_text()), "layer_types": [SLIDING] * 5})
    m = manager(cfg, slabs=5, slab_bytes=8192)     # 10 window pages; the 16-token window of 5 layers
    m.place("a", 80)
    m.place("a", 300)                              # holds page 1 (reads 65..79) and page 4 (285..299)
    assert used(m) == [10, 0, 0] and m.allocator.free_slabs == 0
    assert not m.can_place("b", 1)
    given_back = {int(m.table("a", "window", layer)[1]) for layer in range(5)}
    assert m.can_place("a", 600)                   # gives page 1 back, takes page 9
    m.place("a", 600)
    assert {int(m.table("a", "window", layer)[9]) for layer in range(5)} == given_back
    assert [c for c, p in enumerate(m.table("a", "window", 0)) if p >= 0] == [4, 9]


def test_a_prompt_that_can_never_fit_is_reported():
    m = manager(FLASH, slabs=64)                   # 128 MiB: 2048 large pages
    assert m.fits_ever(8000, chunk=512)
    assert not m.fits_ever(100_000, chunk=512)     # 391 blocks x 21 c4a layers of 64 KiB alone is 513 MiB
    assert not m.can_place("r", 100_000)
    # 32 blocks per compressed layer; a 512-token step's bounds: window 3 + 3 pages, c4a states
    # 2 + 2 pages of 8 tokens, c128a state 9 + 9 pages of 16
    pages = m.plan.class_pages(8000, 512)
    assert pages[LARGE] == 43 * 6 + 21 * 32 + 21 * 4 + 20 * 18
    assert (pages[MEDIUM], pages[SMALL]) == (21 * 32 + 21 * 4, 20 * 32)


def test_new_length_below_the_current_one_is_refused():
    m = manager(TINY, slabs=12, slab_bytes=8192)
    m.place("a", 40)
    with pytest.raises(ValueError, match="below the current 40"):
        m.place("a", 39)
    m.place("a", 40)                               # an empty step: gives back what no step reads
    assert m.length("a") == 40
    with pytest.raises(ValueError, match="layer 1 has no compressed_c4a cache"):
        m.table("a", "compressed_c4a", 1)


steps = st.lists(st.tuples(st.integers(0, 3), st.one_of(st.integers(1, 3), st.integers(1, 300)),
                           st.booleans()), max_size=60)


@settings(max_examples=60, deadline=None)
@given(steps)
def test_random_schedules_keep_tables_and_allocator_in_step(schedule):
    m = manager(TINY, slabs=40, slab_bytes=8192)
    for r, chunk, finish in schedule:
        if finish and r in m:
            m.release(r)
            continue
        length = m.length(r) if r in m else 0
        fits = m.can_place(r, length + chunk)
        try:
            m.place(r, length + chunk)
        except OutOfPages:
            assert not fits
            continue
        assert fits
        for k in m.plan.kinds:
            assert m.held_columns(r, k.name) == sum(b - a for a, b in k.columns(length, length + chunk))
            assert m.held_columns(r, k.name) <= k.pages(length + chunk, chunk)
        live = [r for r in range(4) if r in m]
        assert used(m) == held_by_class(m, live)
        ids = np.concatenate([m.table(q, k.name, layer) for q in live for k in m.plan.kinds for layer in k.layers])
        ids = ids[ids >= 0]
        assert len(np.unique(ids)) == len(ids)
    for r in range(4):
        if r in m:
            m.release(r)
    assert used(m) == [0, 0, 0] and m.allocator.free_slabs == 40


@pytest.mark.parametrize("numerics", ["exact", "faithful"])
@pytest.mark.parametrize("config", ["configs/deepseek-v4-flash.json", "real-ratios/config.json"])
def test_decode_steps_that_reuse_pages_hold_exactly_what_the_step_needs(config, numerics):
    """place() takes a decode step's moves after a decode step from a table by length phase; the pages
    held must still be CacheKind.columns of every step, through decode runs broken by chunks of every size."""
    cfg = from_dict(json.loads((FIXTURES / config).read_text()))
    m = manager(cfg, 4096, numerics=numerics)
    rng, L = np.random.default_rng(0), 0
    for _ in range(3000):
        n = 1 if rng.random() < 0.93 else int(rng.integers(2, 300))
        m.place("r", L + n)
        for k, pages in zip(m.plan.kinds, m._requests["r"].kinds):
            assert pages.held == k.columns(L, L + n), (k.name, L, n)
        L += n


class HostArena:
    """Stands in for the device arena: buffers are host bytes, copies are immediate."""

    class Buffer:
        def __init__(self, nbytes):
            self.bytes, self.ptr, self.nbytes = np.zeros(nbytes, np.uint8), 0, nbytes

        def copy_from_host(self, host, stream=None, offset=0):
            src = np.ascontiguousarray(host).view(np.uint8).ravel()
            self.bytes[offset:offset + len(src)] = src

    def alloc(self, nbytes, what=""):
        return self.Buffer(nbytes)


def test_page_tables_rewritten_by_moved_kinds_equal_tables_written_whole():
    """The device page tables, refreshed kind by kind as requests grow, are released and take other
    slots, hold exactly each slot's page offsets from the block manager."""
    from dsv4rt.model.tables import PageTables
    m = manager(TINY, 64, slab_bytes=64 << 10)
    max_len, slots = 3000, 3
    tables = PageTables(HostArena(), m.plan, m.allocator, max_len, slots)
    rng, lengths, owner, next_id, released = np.random.default_rng(2), {}, [None] * slots, 0, 0
    for _ in range(1500):
        slot = int(rng.integers(slots))
        r = owner[slot]
        if r is None or lengths[r] >= max_len - 200 or rng.random() < 0.01:
            if r is not None:
                m.release(r)
                tables.forget(slot)
                released += 1
            r, next_id = next_id, next_id + 1
            owner[slot], lengths[r] = r, 0
        n = 1 if rng.random() < 0.9 else int(rng.integers(2, 128))
        lengths[r] += n
        m.place(r, lengths[r])
        tables.refresh(slot, m, r, None)
        device = tables.device.bytes.view(np.int64).reshape(slots, -1)
        for s, owned in enumerate(owner):
            expect = np.full(tables.slot_cols, -1, np.int64)
            if owned is not None:
                for (kind, layer), (at, cols, k) in tables.at.items():
                    ids = m.table(owned, kind, layer)[:cols]
                    expect[at:at + len(ids)] = m.allocator.offsets(ids, k.size_class)
            assert np.array_equal(device[s], expect), (s, owned)
    assert released >= 6
