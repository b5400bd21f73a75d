"""Per-request block tables for every cache kind and layer, drawn from the slab allocator.

`place(request, new_len)` readies the step that computes positions [length, new_len): each kind then
holds exactly the page columns of CacheKind.columns, every layer alike. Kinds that keep every page
grow; sliding kinds (window, compressor states) hold what the step reads from the cache and what it
leaves there for the next step, and give the rest back. So a kernel of that step reads cached
positions below `length` only, takes the step's own positions from its workspace, and writes a
position only where the table has a page. Steps run in stream order, so a page given back here and
handed to another request is written only after the steps that read it.
"""
from __future__ import annotations

from typing import Hashable

import numpy as np

from .plan import CacheKind, KVPlan
from .slab import SlabAllocator

Ranges = list[tuple[int, int]]


class OutOfPages(RuntimeError):
    pass


class _Pages:
    """One request's pages of one kind: array[row, c - base] is layer row's page of column c, or -1.
    `version` changes whenever they do."""
    __slots__ = ("base", "array", "held", "end", "version")

    def __init__(self, layers: int):
        self.base, self.end, self.version = 0, 0, -1
        self.array = np.full((layers, 4), -1, np.int32)
        self.held: Ranges = []

    def cover(self, start: int, stop: int) -> None:
        base, width = self.base, self.array.shape[1]
        if start >= base and stop <= base + width:
            return
        # twice the span: compressed kinds grow by doubling, sliding kinds move every span columns
        grown = np.full((self.array.shape[0], max(4, 2 * (stop - start))), -1, np.int32)
        lo, hi = max(base, start), min(base + width, stop)
        if lo < hi:
            grown[:, lo - start:hi - start] = self.array[:, lo - base:hi - base]
        self.base, self.array = start, grown


class _Request:
    __slots__ = ("length", "kinds", "version", "steady", "all_steady")

    def __init__(self, plan: KVPlan):
        self.length, self.version = 0, -1
        self.steady = [0] * len(plan.kinds)   # per kind: one-token steps from lengths below need the pages held
        self.all_steady = 0                   # min(steady): below it a one-token step changes nothing
        self.kinds = [_Pages(len(k.layers)) for k in plan.kinds]


class BlockManager:
    def __init__(self, plan: KVPlan, allocator: SlabAllocator):
        if allocator.page_bytes != plan.class_page_bytes:
            raise ValueError(f"allocator pages {allocator.page_bytes} differ from the plan's {plan.class_page_bytes}")
        self.plan, self.allocator = plan, allocator
        self._kind_index = {k.name: i for i, k in enumerate(plan.kinds)}
        self._rows = [{layer: row for row, layer in enumerate(k.layers)} for k in plan.kinds]
        self._requests: dict[Hashable, _Request] = {}
        self._changes = 0

    def __contains__(self, request: Hashable) -> bool:
        return request in self._requests

    def length(self, request: Hashable) -> int:
        return self._requests[request].length

    def version(self, request: Hashable) -> int:
        """Changes whenever the request's pages do; unique over all requests, so device copies of
        its tables can be kept until it moves."""
        return self._requests[request].version

    def fits_ever(self, total_len: int, chunk: int) -> bool:
        """Whether a request of total_len positions, stepped `chunk` at a time, fits in the empty region."""
        pages = self.plan.class_pages(total_len, chunk)
        slabs = sum(-(-n // per_slab) for n, per_slab in zip(pages, self.allocator.pages_per_slab))
        return slabs <= self.allocator.n_slabs

    def can_place(self, request: Hashable, new_len: int) -> bool:
        """Whether place(request, new_len) would succeed now: the pages it needs net of those it gives back."""
        req = self._requests.get(request) or _Request(self.plan)
        if new_len == req.length + 1 and req.length < req.all_steady:
            return True
        return self.allocator.can_alloc(self._net_pages(req, self._needs(req, new_len)))

    def place(self, request: Hashable, new_len: int) -> None:
        """Hold what the step computing positions [length, new_len) needs; all or nothing (OutOfPages)."""
        if not self.try_place(request, new_len):
            raise OutOfPages(f"request {request!r}: no room for positions up to {new_len}")

    def try_place(self, request: Hashable, new_len: int) -> bool:
        """place(), or False with nothing changed when the pages are lacking."""
        req = self._requests.get(request) or _Request(self.plan)
        if new_len == req.length + 1 and req.length < req.all_steady:
            req.length = new_len
            return True
        needs = self._needs(req, new_len)
        moved = [i for i, (need, pages) in enumerate(zip(needs, req.kinds)) if need != pages.held]
        if moved:
            if not self.allocator.can_alloc(self._net_pages(req, needs)):
                return False
            for i in moved:
                pages = req.kinds[i]
                for start, stop in _minus(pages.held, needs[i]):
                    self._give_back(pages, start, stop)
            for i in moved:
                self._take(i, req.kinds[i], needs[i])
        if moved or req.version < 0:
            self._changes += 1
            req.version = self._changes
            for i in moved:
                req.kinds[i].version = self._changes
        L = req.length
        if new_len == L + 1:
            steady = req.steady
            for i, k in enumerate(self.plan.kinds):
                if L >= steady[i]:
                    steady[i] = _steady_until(k, L)
        else:
            req.steady = [0] * len(req.steady)
        req.all_steady = min(req.steady)
        req.length = new_len
        self._requests[request] = req
        return True

    def release(self, request: Hashable) -> None:
        """Free everything the request holds (it finished or was aborted)."""
        for pages in self._requests.pop(request).kinds:
            for start, stop in pages.held:
                self._give_back(pages, start, stop)

    def table(self, request: Hashable, kind: str, layer: int) -> np.ndarray:
        """Page ids of one layer's cache of `kind` by column (positions [c*P, (c+1)*P)); -1 where none is held."""
        i = self._kind_index[kind]
        row = self._rows[i].get(layer)
        if row is None:
            raise ValueError(f"layer {layer} has no {kind} cache")
        pages = self._requests[request].kinds[i]
        out = np.full(pages.end, -1, np.int32)
        stop = min(pages.end, pages.base + pages.array.shape[1])
        out[pages.base:stop] = pages.array[row, :stop - pages.base]
        return out

    def pages(self, request: Hashable, kind: str) -> tuple[int, int, np.ndarray]:
        """(version, base, array): the request's pages of `kind`, array[row, c - base] for layer row (the
        kind's layers in order) and column c, −1 where none is held; a view, valid until the next place()."""
        p = self._requests[request].kinds[self._kind_index[kind]]
        return p.version, p.base, p.array

    def held_columns(self, request: Hashable, kind: str) -> int:
        """Columns (pages per layer) the request holds of `kind`."""
        return _width(self._requests[request].kinds[self._kind_index[kind]].held)

    def _needs(self, req: _Request, new_len: int) -> list[Ranges]:
        """What each kind needs for the step; a decode step keeps a kind's pages without recomputing them
        until that kind's next change (most steps of most kinds: this is host time per token)."""
        L = req.length
        if new_len < L:
            raise ValueError(f"new length {new_len} is below the current {L}")
        one = new_len == L + 1
        return [pages.held if one and L < until else k.columns(L, new_len)
                for k, pages, until in zip(self.plan.kinds, req.kinds, req.steady)]

    def _net_pages(self, req: _Request, needs: list[Ranges]) -> list[int]:
        counts = [0, 0, 0]
        for k, pages, need in zip(self.plan.kinds, req.kinds, needs):
            if need != pages.held:
                columns = _width(_minus(need, pages.held)) - _width(_minus(pages.held, need))
                counts[k.size_class] += len(k.layers) * columns
        return counts   # negative: the class gets pages back; can_alloc needs none of it

    def _give_back(self, pages: _Pages, start: int, stop: int) -> None:
        held = pages.array[:, start - pages.base:stop - pages.base]
        free = self.allocator.free
        for page in held.ravel().tolist():
            free(page)
        held[...] = -1

    def _take(self, i: int, pages: _Pages, need: Ranges) -> None:
        missing = _minus(need, pages.held)
        pages.held = need
        if not need:
            return
        pages.cover(need[0][0], need[-1][1])
        pages.end = max(pages.end, need[-1][1])
        cls, alloc, rows = self.plan.kinds[i].size_class, self.allocator.alloc, pages.array.shape[0]
        for start, stop in missing:
            ids = [alloc(cls) for _ in range(rows * (stop - start))]
            pages.array[:, start - pages.base:stop - pages.base] = np.array(ids, np.int32).reshape(rows, -1)


def _minus(a: Ranges, b: Ranges) -> Ranges:
    """The columns of the ascending ranges `a` that are not in the ascending ranges `b`."""
    out = []
    for start, stop in a:
        for b_start, b_stop in b:
            if b_stop <= start or b_start >= stop:
                continue
            if b_start > start:
                out.append((start, b_start))
            start = max(start, b_stop)
            if start >= stop:
                break
        if start < stop:
            out.append((start, stop))
    return out


def _width(ranges: Ranges) -> int:
    return sum(stop - start for start, stop in ranges)


def _steady_until(k: CacheKind, L: int) -> int:
    """The first length above L whose one-token step may need other columns of kind k than (L, L+1).

    CacheKind.columns(L, L+1) is a function of ceil((L+1)/P) for kinds that keep every page, and for
    sliding kinds also of floor(keep_from(L)/P), ceil(L/P) and floor(max(L, keep_from(L+1))/P), all
    non-decreasing in L, and of whether its read and write ranges are empty, which changes only at
    multiples of the stride s when s >= width. Each term's next change is computed in closed form."""
    P = k.positions_per_page
    until = [_up(P, L + 1)]                                       # ceil((L+1)/P) moves
    if k.width:
        s, w = k.stride, k.width
        first_length = lambda target: _up(s, target - s + w)     # least L' with keep_from(L') >= target
        until.append(_up(P, L) + 1)                               # ceil(L/P) moves
        until.append(first_length((k.keep_from(L) // P + 1) * P))
        target = (max(L, k.keep_from(L + 1)) // P + 1) * P
        until.append(min(target, first_length(target) - 1))
        if s >= w:
            until += [_up(s, L + 1), _up(s, L + 2) - 1]
    return max(L + 1, min(until))


def _up(a: int, x: int) -> int:
    """The first multiple of a at or above x."""
    return -(-x // a) * a
