"""Page tables of every request slot on the device, refilled only when a request's pages change.

Slot-major: slot s's offsets for every (kind, layer) lie in one row of `slot_cols` int64 values, so
refreshing a request is one copy, and every kernel finds slot s at page_start[s] = s * slot_cols."""
from __future__ import annotations

import numpy as np

from ..kv import BlockManager, SlabAllocator
from ..kv.plan import KVPlan
from .paged import PagedCache


class PageTables:
    def __init__(self, arena, plan: KVPlan, allocator: SlabAllocator, max_len: int, slots: int):
        self.allocator = allocator
        self.at, cols_total = {}, 0
        for k in plan.kinds:
            cols = -(-max_len // k.positions_per_page) + 1
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
        self.versions = [-1] * slots        # the block manager's version of what each slot shows

    def cache(self, kv_base: int, kind: str, layer: int) -> PagedCache:
        at, _, k = self.at[kind, layer]
        per_page = k.positions_per_page if k.sliding else k.page_bytes // k.entry_bytes
        return PagedCache(kv_base, self.device.ptr + 8 * at, self.page_start.ptr, per_page, k.entry_bytes)

    def refresh(self, slot: int, blocks: BlockManager, request, stream) -> None:
        """Make slot's row show the request's pages, unless it already does."""
        version = blocks.version(request)
        if self.versions[slot] == version:   # versions are unique over all requests
            return
        row = np.full(self.slot_cols, -1, np.int64)
        for (kind, layer), (at, cols, k) in self.at.items():
            ids = blocks.table(request, kind, layer)[:cols]
            row[at:at + len(ids)] = self.allocator.offsets(ids, k.size_class)
        changed = np.flatnonzero(row != self.host[slot])
        if len(changed):
            # only the span that moved: long contexts have rows of megabytes, a decode step moves a few pages
            a, b = changed[0], changed[-1] + 1
            self.host[slot, a:b] = row[a:b]
            # Stream-ordered after earlier steps, which may still read the old row; from pageable memory
            # the call returns once the span is staged, so the host may rewrite it at once.
            self.device.copy_from_host(self.host[slot, a:b], stream, offset=(slot * self.slot_cols + a) * 8)
        self.versions[slot] = version

    def forget(self, slot: int) -> None:
        self.versions[slot] = -1
