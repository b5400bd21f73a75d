"""What several kernel families share: paged-cache addressing and launch sequences."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

from ..cuda.device import Launch, Stream


@dataclass(frozen=True)
class PagedCache:
    """One cache kind of one layer for a batch of requests: entry e of request r lies at
    base + pages[page_start[r] + e // per_page] + (e % per_page) * entry_bytes (pages: int64 byte
    offsets, -1 where not held; page_start: int32 per request)."""
    base: int
    pages: int
    page_start: int
    per_page: int
    entry_bytes: int

    def args(self) -> list:
        return [ctypes.c_void_p(self.base), ctypes.c_void_p(self.pages), ctypes.c_void_p(self.page_start),
                ctypes.c_int(self.per_page), ctypes.c_int(self.entry_bytes)]


class LaunchSequence:
    """Launches issued in order on one stream, as one call."""

    def __init__(self, *launches: Launch):
        self.launches = launches

    def __call__(self, stream: Stream):
        for launch in self.launches:
            launch(stream)


NOTHING = LaunchSequence()  # the launch of an empty batch
