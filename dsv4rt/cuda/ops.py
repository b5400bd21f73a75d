"""Launchers for the kernels of cuda_src/: each picks its launch shape once and binds its arguments."""
from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np

from .device import Device, Launch

_STORAGE = {np.dtype(np.float32): "float", np.dtype(ml_dtypes.bfloat16): "__nv_bfloat16"}


def storage_name(dtype) -> str:
    try:
        return _STORAGE[np.dtype(dtype)]
    except KeyError:
        raise ValueError(f"no kernels for storage type {np.dtype(dtype)} (float32 or bfloat16)") from None


def rmsnorm(device: Device, dtype, out: int, x: int, weight: int | None, rows: int, dim: int,
            eps: float) -> Launch:
    """y = w · x · rsqrt(mean(x²) + eps) per row; weight None gives the weightless variant."""
    t = storage_name(dtype)
    k = device.kernel("rmsnorm", f"rmsnorm<{t}>", ("rmsnorm<float>", "rmsnorm<__nv_bfloat16>"))
    vec = 16 // np.dtype(dtype).itemsize
    threads = -(-dim // (4 * vec))  # each thread keeps up to four 16-byte vectors of its row in registers
    block = min(1024, max(32, (threads + 31) // 32 * 32))
    args = [ctypes.c_void_p(out), ctypes.c_void_p(x), ctypes.c_void_p(weight or 0), ctypes.c_int(rows),
            ctypes.c_int(dim), ctypes.c_float(eps)]
    return k.bind(rows, block, args)
