"""Launchers of the attention family: fusion 3 (cuda_src/qkv.cu) and sparse attention (cuda_src/attention.cu,
and the bf16 build's tensor-core kernels cuda_src/attention_mqa.cu and, on Hopper, cuda_src/attention_wgmma.cu)."""
from __future__ import annotations

import ctypes

import numpy as np

from ..cuda.build import WGMMA_ARCH
from ..cuda.device import Device, Launch
from ..cuda.ops import storage_name
from ..kv.entries import kv_entry_bytes, packed_kv, packed_kv_bytes
from .paged import LaunchSequence, PagedCache

MAX_HEAD_DIM = 512             # kMaxHeadDim: a warp keeps one head row in registers
BLOCK_HEADS = 8                # kBlockHeads of attention.cu
ATTENTION_THREADS = 128        # kAttnWarps * 32
TILE_BYTES = 16384             # one shared-memory key tile at head_dim 512; two are in flight
QKV_WARPS = 8
COMBINE_WARPS = 8
MQA_HEADS = 64                 # kMqaHeads of attention_mqa.cu: the heads of one block
MQA_KEYS = 32                  # kMqaKeys: keys per shared-memory tile
MQA_THREADS = 256              # kMqaWarps * 32
WGMMA_HEAD_DIM = 512           # kWgaHd of attention_wgmma.cu (Flash and Pro)
WGMMA_KEYS = 64                # kWgaKeys: keys per shared-memory tile

_QKV = tuple(f"qkv_norm_rope_insert<{t}{f}>" for f in ("", ",true") for t in ("float", "__nv_bfloat16"))
_ATTENTION = (*(f"{k}<{t}>" for k in ("sparse_attention", "attention_combine") for t in ("float", "__nv_bfloat16")),
              "sparse_attention<__nv_bfloat16,true>")
_MQA = ("sparse_attention_mqa<__nv_bfloat16>", "sparse_attention_mqa<__nv_bfloat16,true>")
_WGMMA = ("sparse_attention_wgmma<false>", "sparse_attention_wgmma<true>")


def _check_shape(dtype, head_dim: int, rope_dim: int, caches, pointers, fp8_kv: bool = False):
    vec = 16 // np.dtype(dtype).itemsize
    if not (0 < head_dim <= MAX_HEAD_DIM and head_dim % vec == 0):
        raise ValueError(f"head_dim {head_dim} must be a multiple of {vec} up to {MAX_HEAD_DIM}")
    if not (0 <= rope_dim <= head_dim and rope_dim % 2 == 0):
        raise ValueError(f"rope_dim {rope_dim} must be even and at most head_dim {head_dim}")
    packed = packed_kv(dtype, fp8_kv)
    if packed and (head_dim - rope_dim) % 8:
        raise ValueError(f"packed fp8 entries need head_dim - rope_dim ({head_dim - rope_dim}) a multiple of 8")
    need, align = kv_entry_bytes(dtype, head_dim, rope_dim, fp8_kv), 8 if packed else 16
    for c in caches:
        if c.entry_bytes % align or c.entry_bytes < need or c.per_page <= 0:
            raise ValueError(f"cache entries of {c.entry_bytes} B cannot hold {need} B {align}-byte aligned")
    if any(p % 16 for p in pointers if p):
        raise ValueError("device rows, weights and cache bases must be 16-byte aligned")


def qkv_norm_rope_insert(device: Device, dtype, q: int, kv: int, kv_norm_weight: int, positions: int, req: int,
                         inv_freq: int, window: PagedCache, *, rows: int, heads: int, head_dim: int, rope_dim: int,
                         eps: float, fp8_kv: bool = False, step_kv: int = 0) -> Launch:
    """Fusion 3: q [rows, heads, hd] in place gets the weightless head RMSNorm and RoPE; kv [rows, hd]
    gets RMSNorm (float32 weight [hd]) and RoPE and is stored at window entry positions[t] of request req[t]
    where its page is held, and at row t of `step_kv` ([rows] entries of window.entry_bytes) when given
    (fp8_kv: rounded and stored as kv_entry_bytes describes). Rows with req < 0 are left alone. One warp per
    query head and per kv row."""
    _check_shape(dtype, head_dim, rope_dim, [window], [q, kv, kv_norm_weight, window.base, step_kv], fp8_kv)
    t = storage_name(dtype)
    k = device.kernel("qkv", f"qkv_norm_rope_insert<{t}{',true' if fp8_kv else ''}>", _QKV)
    warps = rows * (heads + 1)
    args = [ctypes.c_void_p(q), ctypes.c_void_p(kv), ctypes.c_void_p(kv_norm_weight), ctypes.c_void_p(positions),
            ctypes.c_void_p(req), ctypes.c_void_p(inv_freq), *window.args(), ctypes.c_int(rows), ctypes.c_int(heads),
            ctypes.c_int(head_dim), ctypes.c_int(rope_dim), ctypes.c_float(eps), ctypes.c_void_p(step_kv)]
    return k.bind(max(1, -(-warps // QKV_WARPS)), QKV_WARPS * 32, args)


def attention_splits(rows: int, heads: int, max_keys: int, dtype, sm_count: int, waves: int = 2,
                     min_tiles: int = 1) -> int:
    """How many blocks share each (row, head block)'s keys: enough for `waves` blocks per SM when rows are
    few (decode), at least `min_tiles` key tiles each. Depends on shapes only, so a graph's launch stays
    valid. (H200, flash-slice batch 1 at 4K: 4 tiles at least made attention 164 -> 328 us per step for
    78 us less in attention_combine.)"""
    tile_keys = TILE_BYTES // (MAX_HEAD_DIM * np.dtype(dtype).itemsize)
    blocks = rows * -(-heads // BLOCK_HEADS)
    return max(1, min(-(-waves * sm_count // blocks), -(-max_keys // (min_tiles * tile_keys))))


def attention_mqa_splits(rows: int, heads: int, max_keys: int, sm_count: int, min_tiles: int = 2) -> int:
    """attention_splits for sparse_attention_mqa, whose blocks take all heads (up to MQA_HEADS) of a row and
    a whole SM each: enough blocks for one wave when rows are few, at least `min_tiles` key tiles each, since
    every split adds heads·head_dim float32 partial sums per row for attention_combine to read back. Depends on
    shapes only, so a graph's launch stays valid."""
    blocks = rows * -(-heads // MQA_HEADS)
    return max(1, min(-(-sm_count // blocks), -(-max_keys // (min_tiles * MQA_KEYS))))


def attention_workspace_bytes(rows: int, heads: int, head_dim: int, splits: int) -> int:
    """Bytes of the workspace sparse_attention needs with `splits` > 1 (partial sums, maxima, denominators)."""
    return 0 if splits <= 1 else rows * heads * splits * (head_dim + 2) * 4


def sparse_attention(device: Device, dtype, out: int, q: int, positions: int, req: int, sink: int, inv_freq: int,
                     window: PagedCache, compressed: PagedCache | None = None, selected: int | None = None, *,
                     rows: int, heads: int, head_dim: int, rope_dim: int, window_size: int, ratio: int = 0,
                     top_k: int = 0, splits: int = 1, workspace: int = 0, fp8_kv: bool = False,
                     step_kv: int = 0) -> Launch | LaunchSequence:
    """out [rows, heads, hd] = inverse-RoPE(softmax attention of q [rows, heads, hd]) over the window
    entries max(0, m-window_size+1) .. m, the compressed entries (compressed given, `ratio` > 0: every
    visible one, or the row's `top_k` int32 choices in `selected` [rows, top_k], -1 for none) and the
    float32 `sink` [heads]. Rows with req < 0 get zeros. `splits` > 1 divides each row's keys among that
    many blocks (decode batches too small to fill the GPU) and needs a `workspace` of
    attention_workspace_bytes(); a second launch merges them. fp8_kv: both caches hold faithful-mode
    entries (kv_entry_bytes); the bf16 build dequantises packed ones in its key loads. step_kv: the step's own
    window entries (qkv_norm_rope_insert's), read in place of the cache for positions of this step, so that a
    request's rows in one step may outnumber the window; without it every window key comes from the cache."""
    return _attention(False, device, dtype, out, q, positions, req, sink, inv_freq, window, compressed, selected,
                      rows, heads, head_dim, rope_dim, window_size, ratio, top_k, splits, workspace, fp8_kv, step_kv)


def sparse_attention_mqa(device: Device, dtype, out: int, q: int, positions: int, req: int, sink: int,
                         inv_freq: int, window: PagedCache, compressed: PagedCache | None = None,
                         selected: int | None = None, *, rows: int, heads: int, head_dim: int, rope_dim: int,
                         window_size: int, ratio: int = 0, top_k: int = 0, splits: int = 1, workspace: int = 0,
                         fp8_kv: bool = False, step_kv: int = 0) -> Launch | LaunchSequence:
    """sparse_attention on the tensor cores, bf16 build only (head_dim a multiple of 16): a block takes a row's
    q for up to MQA_HEADS heads, so each key is read once per row, and computes scores and P·V with bf16
    mma.sync (P rounded to bf16). Same arguments, outputs, workspace layout and merge (attention_combine);
    pick `splits` with attention_mqa_splits and size the workspace for them. fp8_kv: packed entries are
    dequantised (exactly) into the shared-memory key tiles. On Hopper, a launch without splits at head_dim 512
    runs the wgmma kernel instead (same results up to the order of the sums)."""
    return _attention(True, device, dtype, out, q, positions, req, sink, inv_freq, window, compressed, selected,
                      rows, heads, head_dim, rope_dim, window_size, ratio, top_k, splits, workspace, fp8_kv, step_kv)


def _attention(mqa: bool, device, dtype, out, q, positions, req, sink, inv_freq, window, compressed, selected, rows,
               heads, head_dim, rope_dim, window_size, ratio, top_k, splits, workspace, fp8_kv, step_kv):
    if compressed is None and (ratio or selected):
        raise ValueError("compressed entries need the compressed cache")
    if compressed is not None and ratio <= 0:
        raise ValueError("a compressed cache needs its ratio")
    if selected and top_k <= 0:
        raise ValueError("a selection needs top_k")
    if rows <= 0:
        raise ValueError("attention needs at least one row")
    if splits > 1 and not workspace:
        raise ValueError("splits > 1 needs a workspace")
    if mqa and (np.dtype(dtype).itemsize != 2 or head_dim % 16):
        raise ValueError(f"sparse_attention_mqa takes bf16 rows of a multiple of 16 dims, not {np.dtype(dtype)} "
                         f"× {head_dim} (the float32 build runs sparse_attention)")
    caches = [window] + ([compressed] if compressed else [])
    _check_shape(dtype, head_dim, rope_dim, caches, [out, q, workspace, step_kv, *(c.base for c in caches)], fp8_kv)
    t = storage_name(dtype)
    packed = packed_kv(dtype, fp8_kv)
    cmp = compressed or PagedCache(0, 0, 0, 1, 16)
    if mqa and wgmma_attention(device.arch, head_dim, splits):
        return _attention_wgmma(device, out, q, positions, req, sink, inv_freq, window, cmp, selected, rows, heads,
                                head_dim, rope_dim, window_size, ratio if compressed else 0, top_k, packed, step_kv)
    part_o = workspace if splits > 1 else 0
    part_ml = part_o + rows * heads * splits * head_dim * 4 if splits > 1 else 0
    args = [ctypes.c_void_p(out), ctypes.c_void_p(part_o), ctypes.c_void_p(part_ml), ctypes.c_void_p(q),
            ctypes.c_void_p(positions), ctypes.c_void_p(req), ctypes.c_void_p(sink), ctypes.c_void_p(inv_freq),
            *window.args(), *cmp.args(), ctypes.c_void_p(selected or 0), ctypes.c_int(top_k),
            ctypes.c_int(ratio if compressed else 0), ctypes.c_int(window_size), ctypes.c_int(heads),
            ctypes.c_int(head_dim), ctypes.c_int(rope_dim), ctypes.c_float(np.float32(head_dim ** -0.5)),
            ctypes.c_void_p(step_kv)]
    flag = ",true" if packed else ""
    if mqa:
        kernel = device.kernel("attention_mqa", f"sparse_attention_mqa<{t}{flag}>", _MQA)
        block_heads, threads = MQA_HEADS, MQA_THREADS
        shared = attention_mqa_shared_bytes(dtype, head_dim, rope_dim, fp8_kv)
        kernel.allow_shared(shared)
    else:
        kernel = device.kernel("attention", f"sparse_attention<{t}{flag}>", _ATTENTION)
        tile_keys = TILE_BYTES // (MAX_HEAD_DIM * np.dtype(dtype).itemsize)
        block_heads, threads = BLOCK_HEADS, ATTENTION_THREADS
        shared = 2 * tile_keys * kv_entry_bytes(dtype, head_dim, rope_dim, fp8_kv)
    main = kernel.bind((rows, -(-heads // block_heads), max(1, splits)), threads, args, shared=shared)
    if splits <= 1:
        return main
    combine_args = [ctypes.c_void_p(out), ctypes.c_void_p(part_o), ctypes.c_void_p(part_ml), ctypes.c_void_p(sink),
                    ctypes.c_void_p(positions), ctypes.c_void_p(inv_freq), ctypes.c_int(rows), ctypes.c_int(heads),
                    ctypes.c_int(head_dim), ctypes.c_int(rope_dim), ctypes.c_int(splits)]
    combine = device.kernel("attention", f"attention_combine<{t}>", _ATTENTION).bind(
        -(-rows * heads * -(-head_dim // 128) // COMBINE_WARPS), COMBINE_WARPS * 32, combine_args)
    return LaunchSequence(main, combine)


def wgmma_attention(arch: str, head_dim: int, splits: int) -> bool:
    """Whether sparse_attention_mqa runs attention_wgmma.cu: Hopper, head_dim 512, a block per row."""
    return arch == WGMMA_ARCH and head_dim == WGMMA_HEAD_DIM and splits <= 1


def _attention_wgmma(device, out, q, positions, req, sink, inv_freq, window, cmp, selected, rows, heads, head_dim,
                     rope_dim, window_size, ratio, top_k, packed, step_kv) -> Launch:
    args = [ctypes.c_void_p(out), ctypes.c_void_p(q), ctypes.c_void_p(positions), ctypes.c_void_p(req),
            ctypes.c_void_p(sink), ctypes.c_void_p(inv_freq), *window.args(), *cmp.args(),
            ctypes.c_void_p(selected or 0), ctypes.c_int(top_k), ctypes.c_int(ratio), ctypes.c_int(window_size),
            ctypes.c_int(heads), ctypes.c_int(rope_dim), ctypes.c_float(np.float32(head_dim ** -0.5)),
            ctypes.c_void_p(step_kv)]
    kernel = device.kernel("attention_wgmma", f"sparse_attention_wgmma<{'true' if packed else 'false'}>", _WGMMA)
    shared = attention_wgmma_shared_bytes(head_dim, rope_dim, packed)
    kernel.allow_shared(shared)
    return kernel.bind((rows, -(-heads // MQA_HEADS)), MQA_THREADS, args, shared=shared)


def attention_wgmma_shared_bytes(head_dim: int, rope_dim: int, packed: bool) -> int:
    """Dynamic shared memory of sparse_attention_wgmma: 1024 to align, q, key tiles (two; packed: one, and two
    encoded ones), P, row statistics."""
    tile = WGMMA_KEYS * head_dim * 2
    encoded = 2 * WGMMA_KEYS * packed_kv_bytes(head_dim, rope_dim) if packed else 0
    return 1024 + MQA_HEADS * head_dim * 2 + (1 if packed else 2) * tile + MQA_HEADS * WGMMA_KEYS * 2 + 512 + encoded


def attention_mqa_shared_bytes(dtype, head_dim: int, rope_dim: int, fp8_kv: bool = False) -> int:
    """Dynamic shared memory of sparse_attention_mqa: q rows and bf16 key tiles of head_dim + 8 elements (two
    tiles; packed fp8 entries: one, and two encoded ones), and the partial scores its warps swap."""
    packed = packed_kv(dtype, fp8_kv)
    tiles = (MQA_HEADS + (1 if packed else 2) * MQA_KEYS) * (head_dim + 8) * 2
    encoded = 2 * MQA_KEYS * kv_entry_bytes(dtype, head_dim, rope_dim, True) if packed else 0
    return tiles + MQA_THREADS // 32 * MQA_KEYS * 64 + encoded

