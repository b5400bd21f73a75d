"""What a process (or a host embedding us) hands the engine: a device, one arena and a stream."""
from __future__ import annotations

from .arena import Arena
from .device import Device, Stream
from .driver import check, drv, init

ARENA_FRACTION = 0.9  # of free memory, leaving room for cuBLAS workspaces and the driver


class Runtime:
    def __init__(self, device: int = 0, arena_bytes: int | None = None, *, ptr: int | None = None,
                 stream: int | None = None):
        """Own arena of `arena_bytes` (default: most of free memory), or adopt the host's `ptr` of
        `arena_bytes` bytes and its `stream` handle; adopted memory and streams stay the host's. With a
        host's stream, the work runs in that stream's context (the host's own, if it made one)."""
        if ptr is not None and arena_bytes is None:
            raise ValueError("adopting a host allocation needs its size (arena_bytes)")
        self.device = Device(device, None if stream is None else _stream_context(stream))
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


def _stream_context(stream: int):
    """The context a host's stream belongs to (for the legacy stream 0, the thread's current context): kernels,
    modules and cuBLAS must live there, or the host's stream and memory are not theirs to use. None: no context
    is current, so the device's primary one serves."""
    init()
    d = drv()
    context = check(d.cuStreamGetCtx(d.CUstream(int(stream)))) if int(stream) else check(d.cuCtxGetCurrent())
    return context if int(context) else None
