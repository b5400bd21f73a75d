"""What a process (or a host embedding us) hands the engine: a device, one arena and a stream."""
from __future__ import annotations

from .arena import Arena
from .device import Device, Stream

ARENA_FRACTION = 0.9  # of free memory, leaving room for cuBLAS workspaces and the driver


class Runtime:
    def __init__(self, device: int = 0, arena_bytes: int | None = None, *, ptr: int | None = None,
                 stream: int | None = None):
        """Own arena of `arena_bytes` (default: most of free memory), or adopt the host's `ptr` of
        `arena_bytes` bytes and its `stream` handle; adopted memory and streams stay the host's."""
        if ptr is not None and arena_bytes is None:
            raise ValueError("adopting a host allocation needs its size (arena_bytes)")
        self.device = Device(device)
        if arena_bytes is None:
            free, _ = self.device.memory()
            arena_bytes = int(free * ARENA_FRACTION) // (2 << 20) * (2 << 20)
        self.arena = Arena(arena_bytes, ptr)
        self.stream = Stream(stream)

    def close(self):
        self.stream.close()
        self.arena.close()

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.close()
