"""Slab allocator for the KV region of the arena: host metadata handing out byte offsets.

The region is cut into slabs of `slab_bytes`. A slab serves one size class at a time and holds
`slab_bytes // page_bytes` pages of it; it is carved when its class has no free page left and goes
back to the common pool the moment its last page is freed, so no class strands memory that another
needs. A page id is `slab << page_shift | index`, so a kernel finds the page at
`(id >> page_shift) * slab_bytes + (id & (1 << page_shift) - 1) * page_bytes[class]`.

alloc and free are O(1) and allocate nothing: each class has an intrusive doubly linked list of its
slabs with a free page; each slab a stack of freed page indexes plus a bump index over pages never
handed out. The per-slab stacks are made when a slab is first carved for a class and are kept for
reuse when it returns to the pool, so host memory follows the peak use of each class rather than
`region / smallest page`.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass

import numpy as np

DEFAULT_SLAB_BYTES = 2 << 20   # the GPU's large-page size: holds >= 32 of the largest page (64 KiB)
ALIGN = 16


class DoubleFree(ValueError):
    pass


@dataclass(frozen=True)
class ClassStats:
    used_pages: int
    free_pages: int            # free pages inside the slabs this class holds
    slabs: int
    fragmentation: float       # 1 - used bytes / held bytes


class SlabAllocator:
    def __init__(self, total_bytes: int, page_bytes, slab_bytes: int = DEFAULT_SLAB_BYTES):
        self.page_bytes = tuple(int(p) for p in page_bytes)
        if not self.page_bytes or any(p <= 0 or p % ALIGN for p in self.page_bytes):
            raise ValueError(f"page sizes must be positive multiples of {ALIGN} B, got {self.page_bytes}")
        if slab_bytes % ALIGN or slab_bytes < max(self.page_bytes):
            raise ValueError(f"slab of {slab_bytes} B must be a multiple of {ALIGN} B and hold the largest page "
                             f"({max(self.page_bytes)} B)")
        self.slab_bytes = slab_bytes
        self.total_bytes = total_bytes
        self.n_slabs = total_bytes // slab_bytes
        self.pages_per_slab = tuple(slab_bytes // p for p in self.page_bytes)
        self.page_shift = (max(self.pages_per_slab) - 1).bit_length()
        self._mask = (1 << self.page_shift) - 1
        if self.n_slabs << self.page_shift > 1 << 31:
            raise ValueError("region too large: page ids must fit int32 block tables; use bigger slabs")
        self._index_type = "H" if max(self.pages_per_slab) <= 1 << 16 else "I"
        n, classes = self.n_slabs, len(self.page_bytes)
        self._class = [-1] * n       # -1: in the common pool
        self._used = [0] * n
        self._fresh = [0] * n        # pages [fresh, capacity) were never handed out since the slab was carved
        self._top = [0] * n          # height of the slab's stack of freed page indexes
        self._stack: list = [None] * n
        self._live: list = [None] * n    # per page: 1 while allocated (catches double frees)
        self._prev = [-1] * n
        self._next = [-1] * n
        self._partial = [-1] * classes   # head of the list of the class's slabs with a free page
        self._spare_stacks = [[] for _ in range(classes)]
        self._spare_live = [[] for _ in range(classes)]
        self._pool = [0] * n             # stack of slabs returned to the pool
        self._pool_top = 0
        self._untouched = 0              # slabs [untouched, n_slabs) were never carved
        self._used_pages = [0] * classes
        self._held = [0] * classes

    @property
    def free_slabs(self) -> int:
        return self._pool_top + self.n_slabs - self._untouched

    def available(self, cls: int) -> int:
        """Pages `cls` could get now: free pages in its slabs plus every free slab carved for it."""
        return self._free_in_held(cls) + self.free_slabs * self.pages_per_slab[cls]

    def can_alloc(self, counts) -> bool:
        """Whether counts[c] more pages of every class c can be had at once (they compete for free slabs)."""
        slabs = 0
        for cls, n in enumerate(counts):
            short = n - self._free_in_held(cls)
            if short > 0:
                slabs += -(-short // self.pages_per_slab[cls])
        return slabs <= self.free_slabs

    def alloc(self, cls: int) -> int:
        """A free page of class `cls`, or -1 when the region has none."""
        s = self._partial[cls]
        if s < 0:
            s = self._carve(cls)
            if s < 0:
                return -1
        top = self._top[s]
        if top:
            top -= 1
            self._top[s] = top
            index = self._stack[s][top]
        else:
            index = self._fresh[s]
            self._fresh[s] = index + 1
        used = self._used[s] + 1
        self._used[s] = used
        if used == self.pages_per_slab[cls]:
            self._unlink(s, cls)
        self._live[s][index] = 1
        self._used_pages[cls] += 1
        return s << self.page_shift | index

    def alloc_many(self, cls: int, n: int) -> list[int] | None:
        """n pages of class `cls`, or None (and nothing taken) when there are fewer."""
        if n > self.available(cls):
            return None
        return [self.alloc(cls) for _ in range(n)]

    def free(self, page: int) -> None:
        s, index = page >> self.page_shift, page & self._mask
        cls = self._class[s] if 0 <= s < self.n_slabs else -1
        if cls < 0 or index >= self.pages_per_slab[cls] or not self._live[s][index]:
            raise DoubleFree(f"page {page} is not allocated")
        self._live[s][index] = 0
        self._used_pages[cls] -= 1
        used = self._used[s] - 1
        self._used[s] = used
        capacity = self.pages_per_slab[cls]
        if used == 0:
            if capacity > 1:         # a slab of one page was full, hence on no list
                self._unlink(s, cls)
            self._release(s, cls)
            return
        if used == capacity - 1:     # it was full: it has a free page again
            self._link(s, cls)
        top = self._top[s]
        self._stack[s][top] = index
        self._top[s] = top + 1

    def offset(self, page: int) -> int:
        """Byte offset of the page in the region."""
        s, index = page >> self.page_shift, page & self._mask
        cls = self._class[s] if 0 <= s < self.n_slabs else -1
        if cls < 0 or index >= self.pages_per_slab[cls] or not self._live[s][index]:
            raise ValueError(f"page {page} is not allocated")
        return s * self.slab_bytes + index * self.page_bytes[cls]

    def offsets(self, pages: np.ndarray, cls: int) -> np.ndarray:
        """Byte offsets (int64) of an array of pages of one class, unchecked; −1 entries stay −1."""
        pages = np.asarray(pages, np.int64)
        off = (pages >> self.page_shift) * self.slab_bytes + (pages & self._mask) * self.page_bytes[cls]
        return np.where(pages >= 0, off, -1)

    def class_of(self, page: int) -> int:
        return self._class[page >> self.page_shift]

    def stats(self, cls: int) -> ClassStats:
        held_bytes = self._held[cls] * self.slab_bytes
        used = self._used_pages[cls]
        return ClassStats(used, self._free_in_held(cls), self._held[cls],
                          1 - used * self.page_bytes[cls] / held_bytes if held_bytes else 0.0)

    def _free_in_held(self, cls: int) -> int:
        return self._held[cls] * self.pages_per_slab[cls] - self._used_pages[cls]

    def _carve(self, cls: int) -> int:
        if self._pool_top:
            self._pool_top -= 1
            s = self._pool[self._pool_top]
        elif self._untouched < self.n_slabs:
            s = self._untouched
            self._untouched += 1
        else:
            return -1
        self._class[s] = cls
        if self._spare_stacks[cls]:
            self._stack[s] = self._spare_stacks[cls].pop()
            self._live[s] = self._spare_live[cls].pop()
        else:
            capacity = self.pages_per_slab[cls]
            self._stack[s] = array(self._index_type, bytes(capacity * array(self._index_type).itemsize))
            self._live[s] = bytearray(capacity)
        self._held[cls] += 1
        self._link(s, cls)
        return s

    def _release(self, s: int, cls: int) -> None:
        self._spare_stacks[cls].append(self._stack[s])
        self._spare_live[cls].append(self._live[s])   # all zero again: every page was freed
        self._stack[s] = self._live[s] = None
        self._class[s] = -1
        self._fresh[s] = self._top[s] = 0
        self._held[cls] -= 1
        self._pool[self._pool_top] = s
        self._pool_top += 1

    def _link(self, s: int, cls: int) -> None:
        head = self._partial[cls]
        self._prev[s], self._next[s] = -1, head
        if head >= 0:
            self._prev[head] = s
        self._partial[cls] = s

    def _unlink(self, s: int, cls: int) -> None:
        prev, nxt = self._prev[s], self._next[s]
        if prev >= 0:
            self._next[prev] = nxt
        else:
            self._partial[cls] = nxt
        if nxt >= 0:
            self._prev[nxt] = prev
