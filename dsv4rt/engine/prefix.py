"""Prefix cache: the state of a sequence at each 256-position block boundary, keyed by a chained hash
of the tokens before it, so a request whose prompt starts with a cached prefix skips computing it.

An entry's hash covers every token up to its boundary (hash_i = H(hash_{i-1} || block i)), so one
entry alone identifies the whole prefix and holds what the runner needs to resume there exactly.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..kv.plan import BLOCK_POSITIONS


def block_hashes(token_ids: Sequence[int], known: Sequence[bytes] = ()) -> list[bytes]:
    """One chained hash per full block of token_ids; `known`, the hashes of its first blocks, are reused."""
    hashes = list(known)
    for start in range(len(hashes) * BLOCK_POSITIONS, len(token_ids) - BLOCK_POSITIONS + 1, BLOCK_POSITIONS):
        h = hashlib.blake2b(hashes[-1] if hashes else b"", digest_size=16)
        h.update(np.asarray(token_ids[start:start + BLOCK_POSITIONS], dtype="<i4").tobytes())
        hashes.append(h.digest())
    return hashes


@dataclass
class PrefixStats:
    hits: int = 0             # requests that resumed from an entry
    blocks_reused: int = 0
    tokens_skipped: int = 0
    evictions: int = 0


@dataclass
class _Entry:
    blocks: int               # the boundary: position blocks * 256
    snapshot: object          # the runner's state of the sequence at that boundary
    refs: int = 0


class PrefixCache:
    """Entries whose sizes (`size(snapshot)`: 1 each by default, bytes on the GPU) sum to at most
    `capacity`. Entries that requests hold (acquire) are never evicted; the others leave least recently
    used first, handed to `on_evict`. Unheld entries live in their own ordered dict, so eviction is O(1)
    and needs no search past held ones."""

    def __init__(self, capacity: int, size: Callable[[object], int] = lambda snapshot: 1,
                 on_evict: Callable[[object], None] = lambda snapshot: None):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity, self.size, self.on_evict = capacity, size, on_evict
        self.used = 0
        self._free: OrderedDict[bytes, _Entry] = OrderedDict()    # unheld, least recently used first
        self._held: dict[bytes, _Entry] = {}
        self.stats = PrefixStats()

    def __len__(self) -> int:
        return len(self._free) + len(self._held)

    def __contains__(self, key: bytes) -> bool:
        return key in self._free or key in self._held

    def lookup(self, hashes: Sequence[bytes]) -> tuple[int, object | None]:
        """The longest cached prefix of a chain: (its blocks, its snapshot), or (0, None); a hit counts as a use."""
        for i in range(len(hashes) - 1, -1, -1):
            entry = self._touch(hashes[i])
            if entry is not None:
                return entry.blocks, entry.snapshot
        return 0, None

    def insert(self, key: bytes, blocks: int, snapshot: object) -> None:
        """Remember the snapshot at block boundary `blocks` under its chain hash (kept if already there)."""
        if self._touch(key) is None:
            self._free[key] = _Entry(blocks, snapshot)
            self.used += self.size(snapshot)
            self._evict()

    def acquire(self, key: bytes) -> None:
        """A request resumed from this entry: it stays until released, and the hit is counted."""
        entry = self._free.pop(key, None) or self._held[key]
        entry.refs += 1
        self._held[key] = entry
        self.stats.hits += 1
        self.stats.blocks_reused += entry.blocks
        self.stats.tokens_skipped += entry.blocks * BLOCK_POSITIONS

    def release(self, key: bytes) -> None:
        entry = self._held[key]
        entry.refs -= 1
        if not entry.refs:
            self._free[key] = self._held.pop(key)
            self._evict()

    def _touch(self, key: bytes) -> _Entry | None:
        if key in self._free:
            self._free.move_to_end(key)
            return self._free[key]
        return self._held.get(key)

    def _evict(self) -> None:
        while self.used > self.capacity and self._free:
            _, entry = self._free.popitem(last=False)
            self.used -= self.size(entry.snapshot)
            self.on_evict(entry.snapshot)
            self.stats.evictions += 1
