"""One device allocation (ours, or adopted from a host) carved into weights, workspaces and the KV region."""
from __future__ import annotations

import bisect
import ctypes
from dataclasses import dataclass

import numpy as np

from .driver import CudaError, check, drv

ALIGN = 256


class OutOfArena(CudaError):
    pass


@dataclass(frozen=True)
class Span:
    offset: int
    size: int


class Arena:
    """Sub-allocation is first-fit over a sorted list of holes, merged on release: it runs at load
    time and for workspaces, never per token, so simplicity beats speed here."""

    def __init__(self, size: int, ptr: int | None = None):
        """Allocate `size` bytes, or adopt `ptr` (a host's allocation of `size` bytes, which it frees)."""
        if size <= 0:
            raise ValueError(f"arena size must be positive, got {size}")
        self.owned = ptr is None
        if self.owned:
            try:
                self.base = int(check(drv().cuMemAlloc(size)))
            except CudaError as e:
                raise OutOfArena(f"cannot allocate a {size / 2**30:.2f} GiB arena: {e}") from None
        elif ptr % ALIGN:
            raise ValueError(f"an adopted arena must be {ALIGN}-byte aligned, got 0x{ptr:x}")
        else:
            self.base = ptr
        self.size = size
        self.holes = [(0, size)]  # sorted, disjoint, never adjacent: (start, end)
        self.used = 0

    def alloc(self, nbytes: int, what: str = "buffer") -> "Buffer":
        need = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        for i, (start, end) in enumerate(self.holes):
            if end - start >= need:
                if end - start == need:
                    del self.holes[i]
                else:
                    self.holes[i] = (start + need, end)
                self.used += need
                return Buffer(self, Span(start, need), nbytes)
        largest = max((e - s for s, e in self.holes), default=0)
        raise OutOfArena(f"arena out of memory: {what} needs {nbytes / 2**20:.1f} MiB, "
                         f"{(self.size - self.used) / 2**20:.1f} MiB free of {self.size / 2**20:.1f} MiB "
                         f"(largest hole {largest / 2**20:.1f} MiB)")

    def release(self, span: Span):
        start, end = span.offset, span.offset + span.size
        i = bisect.bisect_left(self.holes, (start, end))
        if (i < len(self.holes) and self.holes[i][0] < end) or (i > 0 and self.holes[i - 1][1] > start):
            raise ValueError(f"arena span at offset {start} is already free")
        if i < len(self.holes) and self.holes[i][0] == end:
            end = self.holes.pop(i)[1]
        if i > 0 and self.holes[i - 1][1] == start:
            i -= 1
            start = self.holes.pop(i)[0]
        self.holes.insert(i, (start, end))
        self.used -= span.size

    def close(self):
        if self.owned and self.base:
            check(drv().cuMemFree(self.base))
        self.base = 0


class Buffer:
    """A span of the arena. `array` views it with a shape and dtype."""

    def __init__(self, arena: Arena, span: Span, nbytes: int):
        self.arena, self.span, self.nbytes = arena, span, nbytes
        self.ptr = arena.base + span.offset

    def array(self, shape, dtype) -> "DeviceArray":
        return DeviceArray(self.ptr, tuple(shape), np.dtype(dtype), self)

    def free(self):
        if self.span is not None:
            self.arena.release(self.span)
            self.span = None

    def copy_from_host(self, host: np.ndarray, stream=None, offset: int = 0):
        src = np.ascontiguousarray(host)
        assert offset + src.nbytes <= self.nbytes
        args = (self.ptr + offset, src.ctypes.data, src.nbytes)
        if stream is None:
            check(drv().cuMemcpyHtoD(*args))
        else:
            check(drv().cuMemcpyHtoDAsync(*args, stream.handle))

    def copy_to_host(self, out: np.ndarray, offset: int = 0) -> np.ndarray:
        assert out.flags.c_contiguous and offset + out.nbytes <= self.nbytes
        check(drv().cuMemcpyDtoH(out.ctypes.data, self.ptr + offset, out.nbytes))
        return out


@dataclass
class DeviceArray:
    """A typed view of device memory for interop: CuPy takes it through `__cuda_array_interface__`
    or DLPack. bf16 has no CuPy dtype: view it as uint16."""
    ptr: int
    shape: tuple
    dtype: np.dtype
    owner: object = None

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def __cuda_array_interface__(self) -> dict:
        typestr = f"<u{self.dtype.itemsize}" if self.dtype.kind == "V" else self.dtype.str  # ml_dtypes
        return dict(shape=self.shape, typestr=typestr, data=(self.ptr, False), version=3, strides=None, stream=None)

    def to_host(self) -> np.ndarray:
        out = np.empty(self.shape, self.dtype)
        check(drv().cuMemcpyDtoH(out.ctypes.data, self.ptr, self.nbytes))
        return out

    def __dlpack_device__(self) -> tuple[int, int]:
        return 2, _current_device_ordinal()  # kDLCUDA

    def __dlpack__(self, stream=None, **_):
        from .dlpack import capsule
        return capsule(self)


def _current_device_ordinal() -> int:
    return int(check(drv().cuCtxGetDevice()))


class PinnedBuffer:
    """Page-locked host memory, for copies the DMA engines can run asynchronously."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.ptr = int(check(drv().cuMemHostAlloc(nbytes, 0)))
        self.array = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(self.ptr))

    def close(self):
        if self.ptr:
            self.array = None
            check(drv().cuMemFreeHost(self.ptr))
            self.ptr = 0
