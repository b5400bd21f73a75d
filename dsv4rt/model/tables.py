"""Page tables of every request slot on the device, rewritten only where a request's pages moved.

Slot-major: slot s's offsets for every (kind, layer) lie in one row of `slot_cols` int64 values, and
every kernel finds slot s at page_start[s] = s * slot_cols. A decode step moves a few sliding pages
every few tokens, so a refresh rewrites only the columns of the kinds that moved: a whole row is
megabytes at long contexts."""
from __future__ import annotations

import numpy as np

from ..kv import BlockManager, SlabAllocator
from ..kv.plan import CacheKind, KVPlan
from .paged import PagedCache

STALE = -2      # a version no kind has: the slot's next refresh rewrites every kind


def columns(kind: CacheKind, max_len: int) -> int:
    """Page columns of one layer of `kind` in a slot's row: every page of max_len positions, and one more."""
    return -(-max_len // kind.positions_per_page) + 1


def slot_columns(plan: KVPlan, max_len: int) -> int:
    return sum(len(k.layers) * columns(k, max_len) for k in plan.kinds)


class PageTables:
    def __init__(self, arena, plan: KVPlan, allocator: SlabAllocator, max_len: int, slots: int):
        self.allocator = allocator
        self.at, self.kinds, cols_total = {}, [], 0
        for k in plan.kinds:
            cols = columns(k, max_len)
            self.kinds.append((k, cols_total, cols))      # its layers' columns follow each other
            for layer in k.layers:
                self.at[k.name, layer] = (cols_total, cols, k)
                cols_total += cols
        if slots * cols_total >= 2 ** 31:
            raise ValueError(f"{slots} slots of {max_len} positions need too large page tables; lower either")
        self.slot_cols = cols_total
        self.host = np.full((slots, cols_total), -1, np.int64)
        self.device = arena.alloc(self.host.nbytes, "page tables")
        self.device.copy_from_host(self.host)
        self.page_start = arena.alloc(4 * slots, "page starts")
        self.page_start.copy_from_host(np.arange(slots, dtype=np.int32) * cols_total)
        self.versions = [STALE] * slots     # the block manager's version of what each slot shows
        # per slot and kind: (pages version shown, first column written, column after the last written)
        self.shown = [[(STALE, 0, 0)] * len(self.kinds) for _ in range(slots)]

    def cache(self, kv_base: int, kind: str, layer: int) -> PagedCache:
        at, _, k = self.at[kind, layer]
        per_page = k.positions_per_page if k.sliding else k.page_bytes // k.entry_bytes
        return PagedCache(kv_base, self.device.ptr + 8 * at, self.page_start.ptr, per_page, k.entry_bytes)

    def refresh(self, slot: int, blocks: BlockManager, request, stream) -> None:
        """Make slot's row show the request's pages, unless it already does."""
        version = blocks.version(request)
        if self.versions[slot] == version:   # versions are unique over all requests
            return
        row, shown = self.host[slot], self.shown[slot]
        for i, ((k, first, cols), pages) in enumerate(zip(self.kinds, blocks.all_pages(request))):
            shown_version, lo, hi = shown[i]
            if shown_version == pages.version:
                continue
            base, array = pages.base, pages.array
            layers = row[first:first + len(k.layers) * cols].reshape(len(k.layers), cols)
            new_lo, new_hi = min(base, cols), min(base + array.shape[1], cols)
            if pages.moved is not None and pages.moved[0] == shown_version:
                # one change behind (a decode step): rewrite the columns it gave back and took, the rest stands
                _, give, take = pages.moved
                a, b = cols, 0
                for start, stop in give + take:
                    a, b = min(a, start), max(b, min(stop, cols))
                for start, stop in give:
                    layers[:, start:stop] = -1
                for start, stop in take:
                    stop = min(stop, cols)
                    layers[:, start:stop] = self.allocator.offsets(array[:, start - base:stop - base], k.size_class)
            else:
                # the row shows offsets of the pages in [lo, hi) and −1 elsewhere
                layers[:, lo:hi] = -1
                layers[:, new_lo:new_hi] = self.allocator.offsets(array[:, :new_hi - new_lo], k.size_class)
                a, b = (min(lo, new_lo), max(hi, new_hi)) if hi > lo else (new_lo, new_hi)
            if b > a:
                # One copy per layer, stream-ordered after earlier steps, which may still read the old values;
                # from pageable memory it returns once the span is staged, so the host may rewrite it at once.
                for at in range(first, first + len(k.layers) * cols, cols):
                    self.device.copy_from_host(row[at + a:at + b], stream, offset=8 * (slot * self.slot_cols + at + a))
            shown[i] = (pages.version, new_lo, new_hi)
        self.versions[slot] = version

    def forget(self, slot: int) -> None:
        self.versions[slot] = STALE
        self.shown[slot] = [(STALE, lo, hi) for _, lo, hi in self.shown[slot]]
