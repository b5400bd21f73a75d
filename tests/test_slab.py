"""Slab allocator: disjoint aligned pages, exact statistics, slabs moving between classes."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4rt.kv.slab import DEFAULT_SLAB_BYTES, DoubleFree, SlabAllocator

SLAB = 8192
# 2, 7 and 30 pages per slab, each with an unused tail; a region of 6 slabs and a stray 100 bytes
PAGES = (3008, 1040, 272)
REGION = 6 * SLAB + 100


def check(a: SlabAllocator, live: dict[int, int]) -> None:
    """Every invariant the allocator promises, against the model `live` (page id -> class)."""
    ranges = []
    for page, cls in live.items():
        off, size = a.offset(page), a.page_bytes[cls]
        assert a.class_of(page) == cls
        assert off % 16 == 0
        assert off // SLAB == page >> a.page_shift == (off + size - 1) // SLAB   # inside its slab
        assert off + size <= a.n_slabs * SLAB <= a.total_bytes
        assert off == (page >> a.page_shift) * SLAB + (page & (1 << a.page_shift) - 1) * size
        ranges.append((off, off + size))
    ranges.sort()
    assert all(end <= start for (_, end), (start, _) in zip(ranges, ranges[1:]))
    held = 0
    for cls in range(len(a.page_bytes)):
        s = a.stats(cls)
        used = sum(1 for c in live.values() if c == cls)
        assert s.used_pages == used
        assert s.used_pages + s.free_pages == s.slabs * a.pages_per_slab[cls]
        assert s.fragmentation == (1 - used * a.page_bytes[cls] / (s.slabs * SLAB) if s.slabs else 0.0)
        assert 0 <= s.free_pages < a.pages_per_slab[cls] * max(s.slabs, 1)
        held += s.slabs
    assert held + a.free_slabs == a.n_slabs


ops = st.lists(st.tuples(st.sampled_from(["alloc", "free", "free", "many", "fill"]), st.integers(0, 2),
                         st.integers(0, 40)), max_size=250)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_random_interleavings_keep_every_invariant(steps):
    a = SlabAllocator(REGION, PAGES, SLAB)
    assert (a.n_slabs, a.pages_per_slab) == (6, (2, 7, 30))
    live: dict[int, int] = {}
    for op, cls, n in steps:
        if op == "alloc":
            room = a.available(cls)
            page = a.alloc(cls)
            assert (page < 0) == (room == 0)
            if page >= 0:
                assert page not in live
                live[page] = cls
        elif op == "many":
            room = a.available(cls)
            pages = a.alloc_many(cls, n)
            assert (pages is None) == (n > room)
            assert all(p >= 0 and p not in live for p in pages or [])
            live.update((p, cls) for p in pages or [])
        elif op == "fill":
            room = a.available(cls)
            while (page := a.alloc(cls)) >= 0:
                live[page] = cls
                room -= 1
            assert room == 0
        elif live:
            page = list(live)[n % len(live)]
            a.free(page)
            del live[page]
            with pytest.raises(DoubleFree):
                a.free(page)
        check(a, live)
    for page in list(live):
        a.free(page)
    check(a, {})
    assert a.free_slabs == 6


def test_a_class_that_runs_out_takes_slabs_another_class_freed():
    a = SlabAllocator(REGION, PAGES, SLAB)
    large = [a.alloc(0) for _ in range(12)]          # every slab, 2 pages each
    first_three = {a.offset(p) // SLAB for p in large[:6]}
    assert a.free_slabs == 0 and a.alloc(0) == -1 and a.alloc(2) == -1 and a.available(2) == 0
    for page in large[::2]:                          # half of every slab: nothing returns to the pool
        a.free(page)
    assert a.free_slabs == 0 and a.alloc(2) == -1
    assert a.stats(0).fragmentation == pytest.approx(1 - 6 * 3008 / (6 * SLAB))
    for page in large[1:6:2]:                        # three slabs empty: back in the pool at once
        a.free(page)
    assert a.free_slabs == 3 and a.stats(0).slabs == 3 and a.available(2) == 90
    small = a.alloc_many(2, 90)
    assert small is not None and len(set(small)) == 90
    assert a.stats(2).slabs == 3 and a.stats(2).free_pages == 0 and a.alloc(2) == -1
    assert {a.offset(p) // SLAB for p in small} == first_three      # exactly the slabs class 0 gave up


def test_alloc_many_is_all_or_nothing():
    a = SlabAllocator(REGION, PAGES, SLAB)
    a.alloc_many(1, 40)                              # 6 slabs of 7: 2 pages left
    before = a.stats(1)
    assert a.alloc_many(1, 3) is None and a.stats(1) == before
    assert len(a.alloc_many(1, 2)) == 2 and a.alloc(1) == -1
    assert a.alloc_many(1, 0) == []


def test_can_alloc_counts_shared_slabs():
    a = SlabAllocator(REGION, PAGES, SLAB)
    a.alloc(0)                                       # one slab for class 0, one page of it left
    assert a.can_alloc([1, 7 * 5, 0])                # the free page, then 5 slabs for class 1
    assert not a.can_alloc([2, 7 * 5, 0])            # one more class-0 page needs a 7th slab
    assert a.can_alloc([3, 7 * 4, 0]) and not a.can_alloc([3, 7 * 4, 1])


def test_stats_are_exact():
    a = SlabAllocator(REGION, PAGES, SLAB)
    pages = [a.alloc(2) for _ in range(31)]          # one full slab and one page of the next
    s = a.stats(2)
    assert (s.used_pages, s.free_pages, s.slabs) == (31, 29, 2)
    assert s.fragmentation == pytest.approx(1 - 31 * 272 / (2 * SLAB))
    assert a.free_slabs == 4
    for p in pages:
        a.free(p)
    assert a.stats(2) == a.stats(0) and a.stats(2).slabs == 0 and a.free_slabs == 6


def test_double_and_foreign_frees_raise():
    a = SlabAllocator(REGION, PAGES, SLAB)
    p, q = a.alloc(1), a.alloc(1)
    a.free(p)
    for bad in (p, -1, 1 << 30, q + 1, (5 << a.page_shift)):
        with pytest.raises(DoubleFree):
            a.free(bad)
    with pytest.raises(ValueError):
        a.offset(p)
    a.free(q)
    with pytest.raises(DoubleFree):                  # its slab went back to the pool
        a.free(q)


def test_a_full_slab_with_a_freed_page_serves_the_next_allocation():
    a = SlabAllocator(REGION, PAGES, SLAB)
    pages = a.alloc_many(1, 42)                      # the whole region
    a.free(pages[3])
    assert a.available(1) == 1 and a.alloc(1) == pages[3]


def test_freed_pages_are_reused_first():
    a = SlabAllocator(REGION, PAGES, SLAB)
    pages = [a.alloc(1) for _ in range(5)]
    a.free(pages[3])
    assert a.alloc(1) == pages[3]
    assert a.alloc(1) == pages[4] + 1


def test_one_page_slabs():
    a = SlabAllocator(4 * 4096, (4096, 2048, 16), 4096)
    assert a.pages_per_slab == (1, 2, 256)
    pages = [a.alloc(0) for _ in range(4)]
    assert sorted(a.offset(p) for p in pages) == [0, 4096, 8192, 12288] and a.alloc(0) == -1
    a.free(pages[1])
    assert a.free_slabs == 1 and a.alloc(2) >= 0 and a.alloc(0) == -1


def test_bad_geometry_is_refused():
    with pytest.raises(ValueError, match="hold the largest page"):
        SlabAllocator(1 << 30, (65536, 16384, 2048), 32768)
    with pytest.raises(ValueError, match="multiples of 16"):
        SlabAllocator(1 << 30, (65536, 16385, 2048))
    a = SlabAllocator(80 << 30, (37376, 4352, 1168))
    assert a.slab_bytes == DEFAULT_SLAB_BYTES and a.n_slabs == 40960 and a.pages_per_slab == (56, 481, 1795)
