"""Launchers of the compress family: fusion 1 (cuda_src/compress.cu) and the indexer (cuda_src/indexer.cu)."""
from __future__ import annotations

import ctypes

import numpy as np

from ..cuda.build import WGMMA_ARCH, declared
from ..cuda.device import Device, Launch
from ..cuda.ops import storage_name
from ..kv.entries import indexer_entry_bytes, kv_entry_bytes, packed_kv
from .attention import MAX_HEAD_DIM
from .paged import NOTHING, LaunchSequence, PagedCache

POOL_THREADS = 512        # the most threads of a compress block; wider entries loop over channels
INDEX_HEADS = 64          # kHeads of indexer.cu: heads of one score block
KEY_TILE = 64             # kKeys
SCORE_THREADS = 256
WAVES = 4                 # score blocks per SM to aim for when splitting rows over key tiles
MMA_DIM = 128             # kMmaDim: head_dim of the bf16 tensor-core score kernel
MMA_STAGES = 4            # kStages
MMA_BLOCKS_PER_SM = 2     # its __launch_bounds__ minimum: one wave of blocks streams all keys
MMA_FP4_STAGES = 8        # kFp4Stages: packed key tiles in flight
Q_THREADS = 256           # kQThreads of indexer_q_fp4: a warp per head
CLUSTER = 8               # kCluster: top-k blocks per row while rows are fewer than CLUSTER_ROWS × SMs
CLUSTER_ROWS = 2          # beyond, one block a row (H200, flash-slice 8K prefill in one step: 8 a row took 5.1 ms a layer)
SELECT_THREADS = 512
CANDIDATES = 3072         # top-k candidates a block holds in shared memory (24 KB)
MAX_GRID_Y = 65535
# indexer_wgmma.cu: kRows rows a block, its dynamic shared memory (q tile, 4 key tiles of 128, alignment; fp4 keys: one
# bf16 key tile and 4 raw tiles of 68-byte entries); taken for steps of at least WGMMA_MIN_ROWS rows, where
# consecutive rows share their request (prefill chunks)
WGMMA_ROWS, WGMMA_SHARED, WGMMA_MIN_ROWS = 4, 4 * 64 * 256 + 4 * 128 * 256 + 1024, 512
WGMMA_FP4_SHARED = 4 * 64 * 256 + 128 * 256 + 4 * 128 * 68 + 1024

_POOL = ("compress_pool<float>", "compress_pool<__nv_bfloat16>", "compress_pool<float,true>",
         "compress_pool<__nv_bfloat16,true>", "compress_pool<float,false,true>")
_INDEXER = ("indexer_scores<float>", "indexer_scores<__nv_bfloat16>", "indexer_scores_mma<false>", "indexer_topk<8>",
            "indexer_scores<float,true>", "indexer_scores<__nv_bfloat16,true>", "indexer_scores_mma<true>",
            "indexer_topk<1>")


def hadamard_size(dim: int) -> int:
    """The power of two the rotation pads a row of `dim` values to (reference.quant.rotate)."""
    return 1 << (dim - 1).bit_length()


def state_keep_from(length: int, ratio: int, overlap: bool) -> int:
    """First position a later chunk reads from the compressor state of a request of `length` tokens
    (the state kinds' CacheKind.keep_from): the window of the first unfinished entry, and the one
    before it in the overlapping form."""
    return max(0, length // ratio * ratio - overlap * ratio)


def compress_pool(device: Device, dtype, out: PagedCache, state: PagedCache, a: int, z: int, ape: int, norm: int,
                  inv_freq: int, positions: int, req: int, *, rows: int, width: int, ratio: int, overlap: bool,
                  rope_dim: int, eps: float, fp8_kv: bool = False, fp4_keys: bool = False) -> Launch | LaunchSequence:
    """Fusion 1 over `rows` tokens (req[t] < 0: padding; each request's rows contiguous, consecutive positions).

    a, z: float32 [rows, c·width] (c = 2 if overlap), z without ape; ape float32 [ratio, c·width];
    norm float32 [width]; inv_freq float32 [rope_dim/2]. Every entry j whose last token r·j + r − 1 is
    a row here is pooled (earlier candidates from `state`: float32 [a | z] per raw position), normed,
    roped at r·j and stored into `out` (storage dtype, `width` per entry). Rows at positions
    ≥ state_keep_from(length after this launch) are copied into `state`; those before the launch's
    first row are read from it and must be held there. fp8_kv (the main cache in faithful numerics, width at
    most 512 and a multiple of 8): entries rounded and stored as kv.entries.kv_entry_bytes describes.
    fp4_keys (the indexer cache in faithful numerics): entries rotated, rounded and packed as indexer_entry_bytes
    describes, the same bytes in both builds.
    """
    if not (width > 0 and 0 <= rope_dim <= width and rope_dim % 2 == 0 and width % 2 == 0):
        raise ValueError(f"width {width} and rope_dim {rope_dim} must be even, rope_dim ≤ width")
    c = 2 if overlap else 1
    if state.entry_bytes < 2 * c * width * 4:
        raise ValueError(f"state entries of {state.entry_bytes} B cannot hold a and z ({2 * c * width} floats)")
    if fp8_kv and fp4_keys:
        raise ValueError("fp8_kv is the main cache's format, fp4_keys the indexer cache's: one of them")
    if fp4_keys:
        if out.entry_bytes < indexer_entry_bytes(dtype, width, True):
            raise ValueError(f"fp4 entries of width {width} need {indexer_entry_bytes(dtype, width, True)} B, "
                             f"the cache has {out.entry_bytes}")
    elif fp8_kv:
        need, align = kv_entry_bytes(dtype, width, rope_dim, True), 8 if packed_kv(dtype, True) else 16
        if width > MAX_HEAD_DIM or width % 8 or rope_dim % 8 or out.entry_bytes < need or out.entry_bytes % align:
            raise ValueError(f"fp8 entries need width ≤ {MAX_HEAD_DIM} and rope_dim multiples of 8 and "
                             f"{align}-byte aligned entries of at least {need} B (width {width}, rope_dim "
                             f"{rope_dim}, {out.entry_bytes} B)")
    elif out.entry_bytes < width * np.dtype(dtype).itemsize:
        raise ValueError(f"cache entries of {out.entry_bytes} B cannot hold {width} elements")
    if rows == 0:
        return NOTHING
    if fp4_keys:   # the packed entry does not depend on the storage type: one instantiation serves both builds
        k = device.kernel("compress", "compress_pool<float,false,true>", _POOL)
    else:
        k = device.kernel("compress", f"compress_pool<{storage_name(dtype)}{',true' if fp8_kv else ''}>", _POOL)
    shared = c * ratio * 24 + width * 4   # a Candidate (3 pointers) per pooled position, the pooled entry
    if fp4_keys:
        shared += hadamard_size(width) * 4   # the entry padded for the rotation
    args = [*out.args(), *state.args(), *(ctypes.c_void_p(p) for p in (a, z, ape, norm, inv_freq, positions, req)),
            ctypes.c_int(rows), ctypes.c_int(width), ctypes.c_int(ratio), ctypes.c_int(int(overlap)),
            ctypes.c_int(rope_dim), ctypes.c_float(eps)]
    return k.bind(rows, min(POOL_THREADS, -(-width // 32) * 32), args, shared=shared)


def indexer_select(device: Device, dtype, selected: int, scores: int, q: int, w: int, keys: PagedCache,
                   positions: int, req: int, *, rows: int, heads: int, head_dim: int, topk: int, n_max: int,
                   ratio: int = 4, inv_freq: int | None = None, rope_dim: int = 0,
                   fp4_keys: bool = False) -> LaunchSequence:
    """Indexer scores and top-k for `rows` queries (req[t] < 0: padding, its row of `selected` all -1).

    q: [rows, heads, head_dim] storage dtype, roped here at positions[t] (last rope_dim channels) when
    inv_freq is given, else already roped by the caller; w: float32 [rows, heads] (weights_proj(x)
    scaled by head_dim^-0.5 · heads^-0.5); keys: the indexer-key cache. scores: float32 workspace
    [rows, n_max], n_max at least every row's visible count (pos+1)//ratio (the kernels clamp to it).
    selected: int32 [rows, topk], the min(topk, visible) best entries in ascending index order, ties
    toward the lower index, then -1. The bf16 build at head_dim 128 scores on the tensor cores (q rounded to
    bf16 after the rope): on wgmma, 4 rows a block, for steps of WGMMA_MIN_ROWS rows or more with 64 heads on
    sm_90a; the others in exact float32.
    fp4_keys (faithful numerics): keys holds packed entries (indexer_entry_bytes; 4-byte aligned for the
    tensor-core kernels). A kernel of its own first ropes q (as above), rotates and rounds it in place to the
    values of reference.quant.indexer_round (exact in bf16); the scores dequantise the keys exactly.
    """
    if not (0 < heads <= INDEX_HEADS and head_dim % 8 == 0 and 0 <= rope_dim <= head_dim and rope_dim % 2 == 0):
        raise ValueError(f"indexer: heads {heads} ≤ {INDEX_HEADS}, head_dim {head_dim} % 8 == 0, even rope_dim")
    if rows > MAX_GRID_Y:
        raise ValueError(f"indexer: {rows} query rows, at most {MAX_GRID_Y} per launch (grid y)")
    mma = np.dtype(dtype) != np.float32 and head_dim == MMA_DIM
    if fp4_keys and (keys.entry_bytes < indexer_entry_bytes(dtype, head_dim, True) or mma and keys.entry_bytes % 4):
        raise ValueError(f"indexer: fp4 keys of head_dim {head_dim} need {indexer_entry_bytes(dtype, head_dim, True)} B"
                         f"{' 4-byte aligned' if mma else ''}, the cache has {keys.entry_bytes}")
    if rows == 0:
        return NOTHING
    launches = []
    name = storage_name(dtype)
    if fp4_keys:
        rope = rope_dim if inv_freq else 0
        args = [ctypes.c_void_p(q), ctypes.c_void_p(positions), ctypes.c_void_p(req), ctypes.c_void_p(inv_freq or 0),
                ctypes.c_int(rope), ctypes.c_int(heads)]
        if head_dim == MMA_DIM:   # a head in a warp's registers (indexer_q_fp4_128)
            rotate = device.kernel("indexer_q", f"indexer_q_fp4_128<{name}>", declared("indexer_q"))
            launches.append(rotate.bind(rows, Q_THREADS, args))
        else:
            rotate = device.kernel("indexer_q", f"indexer_q_fp4<{name}>", declared("indexer_q"))
            launches.append(rotate.bind(rows, Q_THREADS, [*args, ctypes.c_int(head_dim)],
                                        shared=(rope + Q_THREADS // 32 * hadamard_size(head_dim)) * 4))  # rope table, rows
        inv_freq = None   # q is roped
    common = [*keys.args(), ctypes.c_void_p(positions), ctypes.c_void_p(req), ctypes.c_void_p(inv_freq or 0),
              ctypes.c_int(rope_dim if inv_freq else 0), ctypes.c_int(heads)]
    tiles = max(1, -(-n_max // KEY_TILE))
    wgmma = mma and heads == INDEX_HEADS and rows >= WGMMA_MIN_ROWS and device.arch == WGMMA_ARCH
    if wgmma:
        score = device.kernel("indexer_wgmma", f"indexer_scores_wgmma<{'true' if fp4_keys else 'false'}>",
                              declared("indexer_wgmma"))
        shared, groups = WGMMA_FP4_SHARED if fp4_keys else WGMMA_SHARED, -(-rows // WGMMA_ROWS)
        splits = min(-(-n_max // (2 * KEY_TILE)), max(1, -(-4 * device.sm_count // groups)))  # even waves
        score_args = [ctypes.c_void_p(scores), ctypes.c_void_p(q), ctypes.c_void_p(w), *common[:-1],
                      ctypes.c_int(rows), ctypes.c_int(n_max), ctypes.c_int(ratio)]
    elif mma:
        score = device.kernel("indexer", f"indexer_scores_mma<{'true' if fp4_keys else 'false'}>", _INDEXER)
        tile = KEY_TILE * (MMA_DIM + 8) * 2   # a bf16 key tile, rows padded by 16 bytes
        if fp4_keys:   # one, and the packed tiles in flight
            shared = tile + MMA_FP4_STAGES * KEY_TILE * indexer_entry_bytes(dtype, MMA_DIM, True)
        else:
            shared = MMA_STAGES * tile
        splits = min(tiles, max(1, MMA_BLOCKS_PER_SM * device.sm_count // rows))
        score_args = [ctypes.c_void_p(scores), ctypes.c_void_p(q), ctypes.c_void_p(w), *common,
                      ctypes.c_int(n_max), ctypes.c_int(ratio)]
    else:
        score = device.kernel("indexer", f"indexer_scores<{name}{',true' if fp4_keys else ''}>", _INDEXER)
        # q and key tiles as float32, rows padded by 4; the rope table
        shared = (INDEX_HEADS + KEY_TILE) * (head_dim + 4) * 4 + head_dim // 2 * 8
        splits = min(tiles, max(1, -(-WAVES * device.sm_count // rows)))
        score_args = [ctypes.c_void_p(scores), ctypes.c_void_p(q), ctypes.c_void_p(w), *common,
                      ctypes.c_int(head_dim), ctypes.c_int(n_max), ctypes.c_int(ratio)]
    score.allow_shared(shared)
    cluster = CLUSTER if rows < CLUSTER_ROWS * device.sm_count else 1
    select = device.kernel("indexer", f"indexer_topk<{cluster}>", _INDEXER)
    share = -(-((n_max + 6) // 4) // cluster)   # float4 groups of a block's share of the row
    candidates = min(CANDIDATES, 4 * share)
    select_shared = 2 * (-(-share // 8) + candidates) * 4   # two bitmaps, candidate keys and indices
    select.allow_shared(select_shared)
    select_args = [ctypes.c_void_p(selected), ctypes.c_void_p(scores), ctypes.c_void_p(positions),
                   ctypes.c_void_p(req), ctypes.c_int(n_max), ctypes.c_int(topk), ctypes.c_int(ratio),
                   ctypes.c_int(candidates)]
    score_grid = (splits, groups if wgmma else rows)
    return LaunchSequence(*launches, score.bind(score_grid, SCORE_THREADS, score_args, shared=shared),
                          select.bind((cluster, rows), SELECT_THREADS, select_args, shared=select_shared))

