"""Arena sub-allocation on the host side (an adopted span needs no GPU)."""
import pytest
from hypothesis import given, settings, strategies as st

from dsv4rt.cuda.arena import ALIGN, Arena, OutOfArena

BASE = 1 << 40  # a made-up device address: adopted arenas never touch the driver


def test_alloc_aligned_and_disjoint():
    a = Arena(1 << 20, ptr=BASE)
    bufs = [a.alloc(n) for n in (1, 255, 256, 257, 4096, 10_000)]
    spans = sorted((b.ptr, b.ptr + b.span.size) for b in bufs)
    assert all(p % ALIGN == 0 for p, _ in spans)
    assert all(e1 <= s2 for (_, e1), (s2, _) in zip(spans, spans[1:]))
    assert a.used == sum(b.span.size for b in bufs)


def test_free_merges_holes_and_reuses_them():
    a = Arena(4096, ptr=BASE)
    x, y, z = a.alloc(1024), a.alloc(1024), a.alloc(2048)
    with pytest.raises(OutOfArena, match="arena out of memory"):
        a.alloc(256)
    y.free()
    x.free()
    assert a.holes == [(0, 2048)]
    assert a.alloc(2048).ptr == BASE
    span = z.span
    z.free()
    with pytest.raises(ValueError, match="already free"):
        a.release(span)


def test_adopted_arena_checks():
    with pytest.raises(ValueError, match="aligned"):
        Arena(4096, ptr=BASE + 8)
    with pytest.raises(ValueError, match="positive"):
        Arena(0, ptr=BASE)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5000)), max_size=60))
def test_random_alloc_free_never_overlaps(ops):
    a = Arena(64 * 1024, ptr=BASE)
    live = []
    for do_alloc, n in ops:
        if do_alloc or not live:
            try:
                live.append(a.alloc(n))
            except OutOfArena:
                pass
        else:
            live.pop(n % len(live)).free()
        spans = sorted((b.span.offset, b.span.offset + b.span.size) for b in live)
        assert all(e1 <= s2 for (_, e1), (s2, _) in zip(spans, spans[1:]))
        assert a.used == sum(b.span.size for b in live)
        assert a.used + sum(e - s for s, e in a.holes) == a.size
        assert all(e1 < s2 for (_, e1), (s2, _) in zip(a.holes, a.holes[1:]))  # holes merged
