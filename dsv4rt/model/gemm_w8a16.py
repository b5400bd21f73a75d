"""Launcher for cuda_src/gemm_w8a16.cu: the faithful-mode output projection wo_a of prefill batches on Hopper's tensor
cores (wgmma, sm_90a only), bf16 activations times the checkpoint's e4m3 weight widened in registers, so that the
weight is never expanded into a scratch buffer (twin: the grouped GEMM on fp8.dequantize's weight)."""
from __future__ import annotations

import ctypes

from ..cuda.build import WGMMA_ARCH, declared
from ..cuda.device import Device, Launch
from ..cuda.ops import storage_name
from .fp8 import BLOCK
from .paged import NOTHING

# gemm_w8a16.cu's kW8Rows (rows of x a block), kW8Cols (weight rows a block), kW8K, kW8Stages, kW8Threads
ROWS, COLS, K_STEP, STAGES, THREADS = 256, 128, 64, 5, 256
# its stages of x (bf16) and raw weight bytes (e4m3), and 1024 to align the swizzled tiles: 201 KiB of the 227
SHARED = STAGES * (ROWS * K_STEP * 2 + COLS * K_STEP) + 1024


def w8a16_fits(arch: str, dtype, n: int, k: int) -> bool:
    """Whether w8a16_gemm takes a bf16 build's grouped projection of n columns and k inputs a group on this arch."""
    return arch == WGMMA_ARCH and storage_name(dtype) == "__nv_bfloat16" and n > 0 and k > 0 and \
        n % BLOCK == 0 and k % BLOCK == 0


def w8a16_gemm(device: Device, y: int, x: int, w: int, w_scale: int, m: int, n: int, k: int, groups: int) -> Launch:
    """y [m, groups·n] (bf16): columns g·n.. = x[:, g·k..] · dequant(w[g·n..])ᵀ for each group g, products exact and
    summed in fp32; x bf16 [m, groups·k], w the e4m3 weight [groups·n, k] with its e8m0 scales w_scale
    [groups·n/128, k/128], each value dequantised as fp8.dequantize does. n and k must be positive multiples of
    128, x and w 16-byte aligned, y 4-byte; m is any."""
    if n <= 0 or k <= 0 or groups <= 0 or n % BLOCK or k % BLOCK:
        raise ValueError(f"the W8A16 GEMM needs n and k to be positive multiples of {BLOCK} and groups positive, got "
                         f"n={n}, k={k}, groups={groups}")
    if x % 16 or w % 16 or y % 4:
        raise ValueError("the W8A16 GEMM needs x and w 16-byte aligned and y 4-byte aligned")
    if m == 0:
        return NOTHING
    if device.arch != WGMMA_ARCH:
        raise RuntimeError(f"the W8A16 GEMM runs on {WGMMA_ARCH} (wgmma) only, this device is {device.arch}")
    kernel = device.kernel("gemm_w8a16", "w8a16_gemm", declared("gemm_w8a16"))
    kernel.allow_shared(SHARED)
    args = [*(ctypes.c_void_p(p) for p in (y, x, w, w_scale)), *(ctypes.c_int(v) for v in (m, n, k))]
    return kernel.bind((n // COLS, -(-m // ROWS), groups), THREADS, args, shared=SHARED)
