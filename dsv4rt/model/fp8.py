"""Launchers for cuda_src/fp8.cu: the faithful-mode activation quantiser and the fp8 decode GEMM
(docs/numerics.md#act-quant; twins: reference.quant.act_quant, and reference.ops.Linear with act_quant on the
dequantised weight).

Every fp8 array is raw bytes (uint8): e4m3 values [rows, k]; e8m0 scales 2^(byte − 127), one per 128 columns
of a row for activations ([rows, ceil(k/128)]), one per 128 x 128 tile for weights (the checkpoint's
[ceil(n/128), ceil(k/128)]). The decode GEMM also takes unquantised inputs (W8A16: wo_a, whose input the
reference does not quantise), and dequantize expands such a weight for prefill GEMMs."""
from __future__ import annotations

import ctypes

import numpy as np

from ..cuda.build import declared
from ..cuda.device import Device, Launch
from ..cuda.ops import storage_name
from .paged import NOTHING

BLOCK = 128            # kFp8Block: columns per scale
QUANT_WARPS = 8        # act_quant: one warp per 128-column block of a row
GEMM_COLUMNS = 16      # output columns (weight rows) of a GEMM block
MAX_GEMM_WARPS = 16    # __launch_bounds__(512)
WIDE_WARPS = 4         # blocks of weights with many rows (gemm_warps)
BLOCKS_PER_WARP = 2    # kernel's U: 128-column blocks whose weight loads a warp has in flight at once




def scale_columns(k: int) -> int:
    return -(-k // BLOCK)


def act_quant(device: Device, dtype, q: int, scale: int, x: int, rows: int, k: int) -> Launch:
    """q [rows, k] e4m3 and scale [rows, ceil(k/128)] e8m0 from x [rows, k] (float32 or bfloat16), bit for bit
    the reference's rounding. Any k; rows of 4·k elements aligned to 16 bytes take vector loads."""
    if rows == 0 or k == 0:
        return NOTHING
    kernel = device.kernel("fp8", f"act_quant<{storage_name(dtype)}>", declared("fp8"))
    tasks = rows * scale_columns(k)
    args = [*(ctypes.c_void_p(p) for p in (q, scale, x)), ctypes.c_int(rows), ctypes.c_int(k)]
    return kernel.bind(-(-tasks // QUANT_WARPS), 32 * QUANT_WARPS, args)


def gemm_warps(k: int, n: int, sm_count: int) -> int:
    """Warps of a GEMM block, which split its 128-column blocks: enough for every warp to keep
    BLOCKS_PER_WARP of them in flight (Flash: k 1024 → 4, 4096 → 16, 8192 → 16). Weights of at least
    3·sm_count 16-row blocks take WIDE_WARPS: small blocks, several a multiprocessor, overlap one another's loads
    and sums (H200, 8192 x 4096 e4m3 at m 1: 12.0 us with 4 warps, 16.8 with 16; 4096 x 8192: 13.2 with 16,
    17.1 with 4)."""
    most = WIDE_WARPS if -(-n // GEMM_COLUMNS) >= 3 * sm_count else MAX_GEMM_WARPS
    return max(1, min(most, -(-scale_columns(k) // BLOCKS_PER_WARP)))


def skinny_gemm(device: Device, out_dtype, y: int, x: int, x_scale: int, w: int, w_scale: int, m: int, n: int,
                k: int, *, in_dtype=None, group_n: int | None = None) -> Launch:
    """y [m, n] (float32 or bfloat16) = x · dequant(w, w_scale)ᵀ, summed per 128-column block in fp32, for decode
    batches (m up to 16 in one pass over the weight; larger m read it once per 16 rows); w/w_scale the
    checkpoint's e4m3 weight [n, k] and its e8m0 scales. in_dtype None: x is act_quant's e4m3 [m, k] with its
    scales x_scale; the output's dtype: x itself (W8A16; x_scale unused). group_n: the n columns fall into
    groups of group_n, group j reading columns j·k.. of x rows of (n / group_n)·k values (the grouped output
    projection), and an e4m3 x's scales [m, n / group_n, ceil(k/128)] (act_quant of m·n / group_n rows of k).
    k must be a multiple of 16, and so must group_n when grouped; every array 16-byte aligned."""
    group_n = group_n or n
    if k % 16:
        raise ValueError(f"the fp8 GEMM needs k to be a multiple of 16, got {k}")
    if group_n != n and (group_n % 16 or n % group_n):
        raise ValueError(f"a grouped fp8 GEMM needs groups of a multiple of 16 columns, got {n} in groups of {group_n}")
    if in_dtype is not None and np.dtype(in_dtype) != np.dtype(out_dtype):
        raise ValueError("a W8A16 GEMM's output has its input's dtype")
    if m == 0 or n == 0:
        return NOTHING
    tiles = 1 if m <= 8 else 2  # 8-row activation tiles of a block
    warps = gemm_warps(k, n, device.sm_count)
    x_type = "E4m3Bytes" if in_dtype is None else storage_name(in_dtype)
    kernel = device.kernel("fp8", f"fp8_skinny_gemm<{storage_name(out_dtype)},{x_type},{tiles}>", declared("fp8"))
    args = [ctypes.c_void_p(p) for p in (y, x, x_scale, w, w_scale)] + [ctypes.c_int(v) for v in (m, n, k, group_n)]
    grid = (-(-n // GEMM_COLUMNS), 1, -(-m // (8 * tiles)))
    return kernel.bind(grid, 32 * warps, args, shared=warps * 8 * tiles * GEMM_COLUMNS * 4)


def dequantize(device: Device, dtype, out: int, w: int, w_scale: int, n: int, k: int) -> Launch:
    """out [n, k] (float32 or bfloat16) = the e4m3 weight w [n, k] times its e8m0 scale per 128 x 128 tile, exact:
    a W8A16 weight expanded for a prefill GEMM. k must be a multiple of 16, w and out 16-byte aligned."""
    if k % 16 or w % 16 or out % 16:
        raise ValueError(f"dequantize needs k to be a multiple of 16 and aligned arrays, got k={k}")
    kernel = device.kernel("fp8", f"dequantize_weight<{storage_name(dtype)}>", declared("fp8"))
    args = [ctypes.c_void_p(out), ctypes.c_void_p(w), ctypes.c_void_p(w_scale), ctypes.c_int(n), ctypes.c_int(k)]
    return kernel.bind(-(-n * k // (16 * 256)), 256, args)
