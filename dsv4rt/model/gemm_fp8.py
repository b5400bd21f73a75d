"""Launcher for cuda_src/gemm_fp8.cu: the faithful-mode fp8 linear layer of prefill batches on Hopper's tensor
cores (wgmma, TMA; sm_90a only), the large-m counterpart of fp8.skinny_gemm with the same operands
(docs/numerics.md#act-quant; twin: reference.ops.Linear with act_quant on the dequantised weight)."""
from __future__ import annotations

import ctypes

import numpy as np

from ..cuda.build import WGMMA_ARCH, declared
from ..cuda.device import Device, Launch
from ..cuda.driver import check, drv
from ..cuda.ops import storage_name
from .paged import NOTHING
from .fp8 import BLOCK

TILE_N = 128                  # kTileN: columns of y in a half of a block
WARPGROUP_ROWS = 64           # kWgRows: rows of y a consumer warpgroup owns
STAGES = {(1, 1): 4, (2, 1): 6, (2, 2): 4}   # kStages<WG, H>
ALIGN_SLACK = 1024            # the kernel aligns its stages to the 128-byte swizzle's 1024-byte period


def threads(warpgroups: int, halves: int) -> int:
    """kThreads<WG, H>: the consumer warpgroups and a producer warp, or with two halves a producer warpgroup."""
    return 128 * warpgroups + (128 if halves == 2 else 32)


def shared_bytes(warpgroups: int, halves: int = 1) -> int:
    """The kernel's dynamic shared memory: its stages of 128 columns of x and w rows, the alignment slack and two
    mbarriers a stage."""
    stage = (WARPGROUP_ROWS * warpgroups + TILE_N * halves) * BLOCK
    return STAGES[warpgroups, halves] * (stage + 16) + ALIGN_SLACK


def warpgroups_for(m: int, n: int, sm_count: int) -> int:
    """128-row blocks (two warpgroups) once their tiles fill the multiprocessors, else 64-row ones (two blocks
    a multiprocessor), which halve the padding of small m and double the blocks."""
    return 2 if -(-m // (2 * WARPGROUP_ROWS)) * (n // TILE_N) >= sm_count else 1


def halves_for(m: int, n: int, group_n: int, warpgroups: int, sm_count: int) -> int:
    """Blocks of 128 rows take 256 columns (two halves) when those tiles still fill the multiprocessors and stay
    within a column group: each k step's x then feeds twice the products (L2 traffic per product down by a
    quarter)."""
    wide = warpgroups == 2 and (group_n == n or group_n % (2 * TILE_N) == 0)
    return 2 if wide and -(-m // (2 * WARPGROUP_ROWS)) * -(-n // (2 * TILE_N)) >= sm_count else 1


def fp8_gemm(device: Device, x_q: int, x_scale: int, w: int, w_scale: int, y: int, m: int, n: int, k: int,
             out_dtype, warpgroups: int | None = None, group_n: int | None = None,
             halves: int | None = None) -> Launch:
    """y [m, n] (float32 or bfloat16) = Σ over 128-column blocks of (x_q · wᵀ) · x_scale · w_scale, each block's
    products summed in fp32 before scaling: x_q [m, k] e4m3 and x_scale [m, k/128] e8m0 from fp8.act_quant,
    w [n, k] e4m3 and w_scale [n/128, k/128] e8m0 the checkpoint's. n and k must be multiples of 128, x_q and w
    16-byte aligned. warpgroups (1 or 2: 64 or 128 rows a block) defaults to warpgroups_for, halves (1 or 2: 128
    or 256 columns a block of two warpgroups) to halves_for. group_n (a multiple of 128 dividing n) groups the
    columns as fp8.skinny_gemm does: x_q [m, g·k] and x_scale [m, g, k/128] for g = n / group_n groups, column
    block j·group_n.. of y reading group j."""
    group_n = group_n or n
    if k == 0 or n == 0 or k % BLOCK or group_n % TILE_N or n % group_n:
        raise ValueError(f"the prefill fp8 GEMM needs n, k and group_n to be positive multiples of 128 (group_n "
                         f"dividing n), got n={n}, k={k}, group_n={group_n}")
    itemsize = np.dtype(out_dtype).itemsize
    if x_q % 16 or w % 16 or y % (2 * itemsize):
        raise ValueError("the prefill fp8 GEMM needs x_q and w 16-byte aligned and y aligned to two elements")
    if warpgroups not in (None, 1, 2):
        raise ValueError(f"warpgroups must be 1 or 2, got {warpgroups}")
    if halves not in (None, 1, 2):
        raise ValueError(f"halves must be 1 or 2, got {halves}")
    if halves == 2 and (warpgroups == 1 or (group_n != n and group_n % (2 * TILE_N))):
        raise ValueError("256-column blocks need two warpgroups and column groups of a multiple of 256")
    if m == 0:
        return NOTHING
    if device.arch != WGMMA_ARCH:
        raise RuntimeError(f"the prefill fp8 GEMM runs on {WGMMA_ARCH} (wgmma) only, this device is {device.arch}")
    groups = warpgroups or (2 if halves == 2 else warpgroups_for(m, n, device.sm_count))
    halves = halves or halves_for(m, n, group_n, groups, device.sm_count)
    box_rows = min(WARPGROUP_ROWS * groups, m)  # a box within the tensor: rows past it stay stale, unstored
    kernel = device.kernel("gemm_fp8", f"fp8_prefill_gemm<{storage_name(out_dtype)},{groups},{halves}>",
                           declared("gemm_fp8"))
    shared = shared_bytes(groups, halves)
    kernel.allow_shared(shared)
    args = [_tensor_map(x_q, m, n // group_n * k, box_rows), _tensor_map(w, n, k, TILE_N * halves),
            *(ctypes.c_void_p(p) for p in (y, x_scale, w_scale)),
            *(ctypes.c_int(v) for v in (m, n, k, box_rows, group_n))]
    grid = (-(-n // (TILE_N * halves)), -(-m // (WARPGROUP_ROWS * groups)))
    return kernel.bind(grid, threads(groups, halves), args, shared=shared)


def _tensor_map(ptr: int, rows: int, k: int, box_rows: int) -> ctypes.Array:
    """The TMA descriptor of a row-major byte matrix [rows, k] read in boxes of box_rows x 128 bytes, which land
    in shared memory with the 128-byte swizzle that wgmma's descriptors name; reads past the rows give zeros."""
    d = drv()
    u64, u32 = d.cuuint64_t, d.cuuint32_t
    tensor_map = check(d.cuTensorMapEncodeTiled(
        d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, ptr, [u64(k), u64(rows)], [u64(k)],
        [u32(BLOCK), u32(box_rows)], [u32(1), u32(1)], d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B, d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE))
    return (ctypes.c_ubyte * 128).from_buffer_copy(ctypes.string_at(int(tensor_map.getPtr()), 128))

