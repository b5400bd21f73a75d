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

import functools
import math
from typing import Hashable

import numpy as np

from .plan import KVPlan
from .slab import SlabAllocator

Ranges = list[tuple[int, int]]
Move = tuple[int, Ranges, Ranges, Ranges]     # (kind index, columns given back, columns taken, columns then held)


class OutOfPages(RuntimeError):
    pass


class _Pages:
    """One request's pages of one kind: array[row, c - base] is layer row's page of column c, or -1.
    `version` changes whenever they do; `moved` is (the version before, columns given back, columns
    taken) of the last change, so a copy of the tables one change behind can be brought up to date."""
    __slots__ = ("base", "array", "held", "end", "version", "moved")

    def __init__(self, layers: int):
        self.base, self.end, self.version = 0, 0, -1
        self.array = np.full((layers, 4), -1, np.int32)
        self.held: Ranges = []
        self.moved: tuple[int, Ranges, Ranges] | None = None

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
    __slots__ = ("length", "kinds", "version", "one_token")

    def __init__(self, plan: KVPlan):
        self.length, self.version = 0, -1
        self.one_token = False     # the last step computed one position: each kind holds columns(length - 1, length)
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
        # What a one-token step after a one-token step moves repeats with the length (see _decode_moves)
        self._period = math.lcm(*(x for k in plan.kinds for x in (k.positions_per_page, k.stride) if x))
        self._periodic_from = _up(self._period, max([k.width for k in plan.kinds] + [1]))
        self._decode = _decode_table(plan)
        self._geometry = [(k.positions_per_page, k.sliding) for k in plan.kinds]

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
        if req.one_token and new_len == req.length + 1:
            net = self._decode_moves(req.length)[1]
            return net is None or self.allocator.can_alloc(net)
        return self.allocator.can_alloc(self._net_pages(self._moves_of(req, new_len)))

    def place(self, request: Hashable, new_len: int) -> None:
        """Hold what the step computing positions [length, new_len) needs; all or nothing (OutOfPages)."""
        if not self.try_place(request, new_len):
            raise OutOfPages(f"request {request!r}: no room for positions up to {new_len}")

    def try_place(self, request: Hashable, new_len: int) -> bool:
        """place(), or False with nothing changed when the pages are lacking."""
        req = self._requests.get(request) or _Request(self.plan)
        L = req.length
        if req.one_token and new_len == L + 1:       # a decode step: host time per token
            moves, net, shift = self._decode_moves(L)
            if not moves:
                req.length = new_len
                return True
            if net is not None and not self.allocator.can_alloc(net):
                return False
            if shift:
                moves = [self._shifted(move, shift) for move in moves]
        else:
            moves = self._moves_of(req, new_len)
            if moves and not self.allocator.can_alloc(self._net_pages(moves)):
                return False
        if moves or req.version < 0:
            self._changes += 1
            req.version = self._changes
        kinds = req.kinds
        for i, give, _, _ in moves:      # every kind gives back before any takes: a step may need what it frees
            for start, stop in give:
                self._give_back(kinds[i], start, stop)
        for i, give, take, need in moves:
            pages = kinds[i]
            pages.held, pages.moved, pages.version = need, (pages.version, give, take), req.version
            if take:
                self._take(i, pages, take)
        req.length, req.one_token = new_len, new_len == L + 1
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

    def all_pages(self, request: Hashable) -> list[_Pages]:
        """The request's pages of every kind, in the plan's order (see _Pages: `version`, `base`, `array`,
        `moved`); valid until the next place()."""
        return self._requests[request].kinds

    def held_columns(self, request: Hashable, kind: str) -> int:
        """Columns (pages per layer) the request holds of `kind`."""
        return _width(self._requests[request].kinds[self._kind_index[kind]].held)

    def _moves_of(self, req: _Request, new_len: int) -> list[Move]:
        """The moves of the kinds whose columns the step changes."""
        if new_len < req.length:
            raise ValueError(f"new length {new_len} is below the current {req.length}")
        return _moves(self.plan, [pages.held for pages in req.kinds], req.length, new_len)

    def _net_pages(self, moves: list[Move]) -> list[int]:
        counts = [0, 0, 0]
        for i, give, take, _ in moves:
            k = self.plan.kinds[i]
            counts[k.size_class] += len(k.layers) * (_width(take) - _width(give))
        return counts   # negative: the class gets pages back; can_alloc needs none of it

    def _decode_moves(self, L: int) -> tuple[list[Move], list[int] | None, int]:
        """A one-token step from L after one from L - 1: its moves, its net pages per class (None when it
        needs none) and how many positions to shift the moves by. They repeat every `_period` lengths once
        no sliding kind's keep_from is clamped at 0 (L >= every width), so each phase is computed once."""
        phase = L if L < self._periodic_from else self._periodic_from + (L - self._periodic_from) % self._period
        known = self._decode.get(phase)
        if known is None:
            held = [k.columns(phase - 1, phase) for k in self.plan.kinds]
            moves = _moves(self.plan, held, phase, phase + 1)
            net = self._net_pages(moves)
            known = self._decode[phase] = moves, net if max(net) > 0 else None
        return known[0], known[1], L - phase

    def _shifted(self, move: Move, positions: int) -> Move:
        """A decode move `positions` (a multiple of the period) later; a kind that keeps every page keeps
        its first column."""
        i, give, take, need = move
        per_page, sliding = self._geometry[i]
        s = positions // per_page
        need = [(a + s, b + s) for a, b in need] if sliding else [(0, need[0][1] + s)]
        return i, [(a + s, b + s) for a, b in give], [(a + s, b + s) for a, b in take], need

    def _give_back(self, pages: _Pages, start: int, stop: int) -> None:
        lo, hi = start - pages.base, stop - pages.base
        # a decode step moves one column: its strided view lists its pages without a copy
        held = pages.array[:, lo] if hi == lo + 1 else pages.array[:, lo:hi]
        free = self.allocator.free
        for page in held.ravel().tolist():
            free(page)
        held.fill(-1)

    def _take(self, i: int, pages: _Pages, take: Ranges) -> None:
        """Pages for the columns `take` of the columns now held."""
        pages.cover(pages.held[0][0], pages.held[-1][1])
        pages.end = max(pages.end, take[-1][1])
        cls, alloc, rows = self.plan.kinds[i].size_class, self.allocator.alloc, pages.array.shape[0]
        for start, stop in take:
            lo, hi = start - pages.base, stop - pages.base
            ids = [alloc(cls) for _ in range(rows * (hi - lo))]
            if hi == lo + 1:
                pages.array[:, lo] = ids
            else:
                pages.array[:, lo:hi] = np.array(ids, np.int32).reshape(rows, -1)


def _moves(plan: KVPlan, held: list[Ranges], length: int, new_len: int) -> list[Move]:
    moves = []
    for i, k in enumerate(plan.kinds):
        need = k.columns(length, new_len)
        if need != held[i]:
            moves.append((i, _minus(held[i], need), _minus(need, held[i]), need))
    return moves


@functools.cache
def _decode_table(plan: KVPlan) -> dict[int, tuple[list[Move], list[int] | None]]:
    """BlockManager._decode_moves by phase, shared by the block managers of a plan."""
    return {}


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


def _up(a: int, x: int) -> int:
    """The first multiple of a at or above x."""
    return -(-x // a) * a
