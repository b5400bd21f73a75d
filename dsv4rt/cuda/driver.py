"""The CUDA driver API through cuda-bindings (12.x and 13.x), with every result checked."""
from __future__ import annotations

from functools import lru_cache


class CudaError(RuntimeError):
    pass


def drv():
    from cuda.bindings import driver
    return driver


def check(result):
    """cuda-bindings returns (CUresult, *values); raise on failure, else return the value(s)."""
    err, *values = result
    if int(err) != 0:
        d = drv()
        _, name = d.cuGetErrorName(err)
        _, text = d.cuGetErrorString(err)
        raise CudaError(f"{name.decode() if name else int(err)}: {text.decode() if text else 'unknown error'}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


@lru_cache(maxsize=None)
def init() -> int:
    """cuInit once; returns the number of visible devices. Raises CudaError when there is no driver."""
    try:
        d = drv()
        check(d.cuInit(0))
        return check(d.cuDeviceGetCount())
    except CudaError:
        raise
    except Exception as e:  # no driver library, no cuda-bindings: the same answer for the caller
        raise CudaError(f"no CUDA driver: {e}") from None


def gpu_visible() -> bool:
    try:
        return init() > 0
    except CudaError:
        return False
