"""Page tables of every request slot on the device, rewritten only where a request's pages moved.

Slot-major: slot s's offsets for every (kind, layer) lie in one row of `slot_cols` int64 values, and
every kernel finds slot s at page_start[s] = s * slot_cols. A decode step moves a few sliding pages
every few tokens, so a refresh rewrites only the columns of the kinds that moved: a whole row is
megabytes at long contexts."""
from __future__ import annotations

import numpy as np

from ..kv import BlockManager, SlabAllocator
from ..kv.plan import KVPlan
from .paged import PagedCache

STALE = -2      # a version no kind has: the slot's next refresh rewrites every kind


class PageTables:
    def __init__(self, arena, plan: KVPlan, allocator: SlabAllocator, max_len: int, slots: int):
        self.allocator = allocator
        self.at, self.kinds, cols_total = {}, [], 0
        for k in plan.kinds:
            cols = -(-max_len // k.positions_per_page) + 1
            starts = []
            for layer in k.layers:
                self.at[k.name, layer] = (cols_total, cols, k)
                starts.append(cols_total)
                cols_total += cols
            self.kinds.append((k, starts, cols))
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
        for i, (k, starts, cols) in enumerate(self.kinds):
            kind_version, base, pages = blocks.pages(request, k.name)
            if shown[i][0] == kind_version:
                continue
            _, lo, hi = shown[i]
            new_lo, new_hi = min(base, cols), min(base + pages.shape[1], cols)
            offsets = self.allocator.offsets(pages[:, :new_hi - new_lo], k.size_class)
            a, b = (min(lo, new_lo), max(hi, new_hi)) if hi > lo else (new_lo, new_hi)
            for at, layer_offsets in zip(starts, offsets):
                row[at + lo:at + hi] = -1
                row[at + new_lo:at + new_hi] = layer_offsets
                if b > a:
                    # Stream-ordered after earlier steps, which may still read the old values; from pageable
                    # memory the call returns once the span is staged, so the host may rewrite it at once.
                    self.device.copy_from_host(row[at + a:at + b], stream, offset=8 * (slot * self.slot_cols + at + a))
            shown[i] = (kind_version, new_lo, new_hi)
        self.versions[slot] = version

    def forget(self, slot: int) -> None:
        self.versions[slot] = STALE
        self.shown[slot] = [(STALE, lo, hi) for _, lo, hi in self.shown[slot]]
