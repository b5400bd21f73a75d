"""Device, streams, events, CUDA graphs and kernel launches over the driver API."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

from .driver import CudaError, check, drv, init


class Stream:
    """A CUDA stream: our own (non-blocking) or adopted from a host, which keeps ownership."""

    def __init__(self, handle=None):
        d = drv()
        self.owned = handle is None
        self.handle = check(d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING)) if self.owned \
            else d.CUstream(int(handle))

    @property
    def ptr(self) -> int:
        return int(self.handle)

    def synchronize(self):
        check(drv().cuStreamSynchronize(self.handle))

    def wait(self, event: "Event"):
        check(drv().cuStreamWaitEvent(self.handle, event.handle, 0))

    def record(self, event: "Event | None" = None) -> "Event":
        event = event or Event()
        check(drv().cuEventRecord(event.handle, self.handle))
        return event

    def close(self):
        if self.owned and self.handle is not None:
            check(drv().cuStreamDestroy(self.handle))
        self.handle = None


class Event:
    def __init__(self, timing: bool = True):
        d = drv()
        flags = 0 if timing else d.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self.handle = check(d.cuEventCreate(flags))

    def synchronize(self):
        check(drv().cuEventSynchronize(self.handle))

    def elapsed_ms(self, later: "Event") -> float:
        return check(drv().cuEventElapsedTime(self.handle, later.handle))

    def close(self):
        if self.handle is not None:
            check(drv().cuEventDestroy(self.handle))
            self.handle = None


class Graph:
    """Launches captured on a stream, instantiated once, replayed many times."""

    def __init__(self, stream: Stream):
        self.stream = stream
        self.graph = self.exec = None

    def __enter__(self) -> "Graph":
        d = drv()
        check(d.cuStreamBeginCapture(self.stream.handle, d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
        return self

    def __exit__(self, exc_type, *_):
        graph = check(drv().cuStreamEndCapture(self.stream.handle))
        if exc_type is None:
            self.graph = graph
            self.exec = check(drv().cuGraphInstantiate(graph, 0))
        else:
            check(drv().cuGraphDestroy(graph))

    def replay(self, stream: Stream | None = None):
        check(drv().cuGraphLaunch(self.exec, (stream or self.stream).handle))

    def close(self):
        if self.exec is not None:
            check(drv().cuGraphExecDestroy(self.exec))
            check(drv().cuGraphDestroy(self.graph))
            self.exec = self.graph = None


@dataclass
class Kernel:
    """One __global__ function. Arguments are ctypes values (c_void_p for pointers, c_int, c_float...)."""
    function: object
    name: str

    def bind(self, grid, block, args, shared: int = 0) -> "Launch":
        """Pack the arguments once; the returned launch can be issued many times (decode steps)."""
        return Launch(self, _dim3(grid), _dim3(block), shared, list(args))

    def launch(self, grid, block, args, stream: Stream, shared: int = 0):
        self.bind(grid, block, args, shared)(stream)

    def allow_shared(self, nbytes: int):
        """Dynamic shared memory beyond 48 KB less the static share needs the opt-in; only ever raised, since
        launches bound (and graphs captured) earlier may need more."""
        attr = drv().CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        if nbytes > check(drv().cuFuncGetAttribute(attr, self.function)):
            check(drv().cuFuncSetAttribute(self.function, attr, nbytes))


class Launch:
    def __init__(self, kernel: Kernel, grid, block, shared: int, args: list):
        self.kernel, self.grid, self.block, self.shared, self.args = kernel, grid, block, shared, args
        self.params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        self.address = ctypes.addressof(self.params)

    def __call__(self, stream: Stream):
        check(_launch(self.kernel.function, *self.grid, *self.block, self.shared, stream.handle, self.address, 0))


def _launch(*args):
    return drv().cuLaunchKernel(*args)


def _dim3(v) -> tuple[int, int, int]:
    v = (v,) if isinstance(v, int) else tuple(v)
    return v + (1,) * (3 - len(v))


class Device:
    """One GPU and its primary context (the one CuPy and other runtime-API users share), or a host's own
    context, whose device it then is."""

    def __init__(self, ordinal: int = 0, context=None):
        count = init()
        d = drv()
        if context is None:
            if not 0 <= ordinal < count:
                raise CudaError(f"device {ordinal} requested, {count} visible")
            self.handle = check(d.cuDeviceGet(ordinal))
            self.context = check(d.cuDevicePrimaryCtxRetain(self.handle))
            check(d.cuCtxSetCurrent(self.context))
        else:
            self.context = context
            check(d.cuCtxSetCurrent(context))
            self.handle = check(d.cuCtxGetDevice())
        self.ordinal = int(self.handle)
        attr = d.CUdevice_attribute
        self.capability = (check(d.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.handle)),
                           check(d.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.handle)))
        self.sm_count = check(d.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, self.handle))
        self.name = check(d.cuDeviceGetName(256, self.handle)).split(b"\0")[0].decode()
        self._modules: dict = {}

    @property
    def arch(self) -> str:
        from .build import device_arch
        return device_arch(self.capability)

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes."""
        return check(drv().cuMemGetInfo())

    def kernel(self, source: str, expression: str, name_expressions=()) -> Kernel:
        """The function `expression` (e.g. "rmsnorm<float>") of cuda_src/`source`.cu, compiled and cached."""
        key = (source, tuple(name_expressions) or (expression,))
        if key not in self._modules:
            from .build import compile_module
            mod = compile_module(source, self.arch, name_expressions=key[1])
            self._modules[key] = (mod, check(drv().cuModuleLoadData(mod.cubin)))
        mod, handle = self._modules[key]
        lowered = mod.lowered[expression]
        return Kernel(check(drv().cuModuleGetFunction(handle, lowered.encode())), expression)

    def synchronize(self):
        check(drv().cuCtxSynchronize())
