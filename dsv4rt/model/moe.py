"""Mixture of experts on the GPU (twin: dsv4rt/reference/moe.py). One bound sequence, no host
synchronisation, so a CUDA graph can hold it: gate GEMM (cuBLAS, fp32 logits) → routing → counting
sort of the (token, slot) pairs by expert → grouped GEMM w1/w3 + clamped SwiGLU times the routing weight →
grouped GEMM w2 → shared expert → the sum of each token's rows. Batches whose experts see a few rows each take the
skinny grouped GEMM, which streams each expert's weights once per 8 rows and carries the shared expert as extra
row tiles (H200, bf16 Flash, 1 token: 94 us for the 7 experts' 352 MB, 3.75 TB/s); larger ones a tiled grouped
GEMM (`grouped_path`): wgmma on sm_90a (cuda_src/moe_wgmma.cu) or mma.sync (cuda_src/moe_mma.cu) for bf16 with dim
and inter multiples of 64, else moe.cu's, and cuBLAS for the shared expert."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from ..cuda.arena import ALIGN, Buffer
from ..cuda.build import WGMMA_ARCH, declared
from ..cuda.device import Device, Launch
from ..cuda.ops import storage_name
from .gemm import Blas, linear

MAX_EXPERTS, MAX_ACTIVE = 384, 8  # moe.cu's kMaxExperts, kMaxActive
TILE_N = 64
GEMM_THREADS = 256
SKINNY_ROWS, SKINNY_WARPS, SKINNY_W = 8, 4, 4  # moe.cu's kSkinnyRows, kSkinnyWarps, kSkinnyW
# moe_mma.cu's kMmaRows, kMmaCols, kMmaK, kMmaStages, kMmaWarps
MMA_ROWS, MMA_COLS, MMA_K, MMA_STAGES, MMA_WARPS = 64, 256, 32, 4, 4
MMA_SHARED = MMA_STAGES * (MMA_ROWS + MMA_COLS) * (MMA_K + 8) * 2
MMA_MULTIPLE = 64
# moe_wgmma.cu's kWgRows, kWgCols, kWgK, kWgStages, kWgThreads and its dynamic shared memory
WGMMA_ROWS, WGMMA_COLS, WGMMA_K, WGMMA_STAGES, WGMMA_THREADS = 128, 256, 64, 4, 256
WGMMA_SHARED = WGMMA_STAGES * (WGMMA_ROWS + WGMMA_COLS) * WGMMA_K * 2 + 1024
# With tensor cores the tiled path reads each expert once however many rows it has, the skinny kernel once per 8:
# skinny only while experts average at most this many rows (without, while they average at most 16).
SKINNY_MEAN_TENSOR, SKINNY_MEAN = 4, 16
PATH_TILE_ROWS = dict(skinny=SKINNY_ROWS, wgmma=WGMMA_ROWS, mma=MMA_ROWS, tiled=64)


@dataclass(frozen=True)
class MoeDims:
    tokens: int
    dim: int
    inter: int
    experts: int
    active: int
    shared_inter: int = 0  # 0: no shared expert

    @property
    def pairs(self) -> int:
        return self.tokens * self.active

    def max_tiles(self, tile_rows: int) -> int:
        """Row tiles over all experts, whatever the routing: each holds a row, and only the last of each
        expert is partial."""
        return min(self.pairs, -(-self.pairs // tile_rows) + min(self.experts, self.pairs))


def grouped_path(arch: str | None, dtype, d: MoeDims) -> str:
    """The grouped GEMMs' kernel, a key of PATH_TILE_ROWS, for a device of this arch."""
    tensor = mma_fits(dtype, d.inter, d.dim)
    if d.pairs <= (SKINNY_MEAN_TENSOR if tensor else SKINNY_MEAN) * min(d.experts, d.pairs):
        return "skinny"
    if not tensor:
        return "tiled"
    return "wgmma" if arch == WGMMA_ARCH else "mma"


def _layout(d: MoeDims, dtype) -> dict[str, int]:
    """Byte offsets of the scratch arrays inside the workspace."""
    t, f4, i4 = np.dtype(dtype).itemsize, 4, 4
    sizes = dict(logits=d.tokens * d.experts * f4, idx=d.pairs * i4, weight=d.pairs * f4,
                 offsets=(d.experts + 1) * i4, tile_offsets=(d.experts + 1) * i4, perm=d.pairs * i4,
                 pos=d.pairs * i4, hidden=d.pairs * d.inter * t, expert_out=d.pairs * d.dim * t,
                 shared_g=d.tokens * d.shared_inter * f4, shared_u=d.tokens * d.shared_inter * f4,
                 shared_h=d.tokens * d.shared_inter * t, shared_out=d.tokens * d.dim * f4 if d.shared_inter else 0)
    return packed_offsets(sizes)


def packed_offsets(sizes: dict[str, int]) -> dict[str, int]:
    """Byte offsets of arrays of these sizes laid one after another, each ALIGN-aligned, and their "total"."""
    offsets, at = {}, 0
    for name, size in sizes.items():
        offsets[name] = at
        at += -(-size // ALIGN) * ALIGN
    offsets["total"] = at
    return offsets


def workspace_bytes(dims: MoeDims, dtype) -> int:
    return _layout(dims, dtype)["total"]


def pointer_table(arena, pointers) -> Buffer:
    """A device array of the experts' weight addresses (they need not be stacked)."""
    host = np.asarray(pointers, np.uint64)
    buf = arena.alloc(host.nbytes, "expert pointer table")
    buf.copy_from_host(host)
    return buf


def route(device: Device, logits: int, idx: int, weight: int, tokens: int, experts: int, active: int,
          scaling: float, *, bias: int | None = None, tid2eid: int | None = None, ids: int | None = None) -> Launch:
    """idx int32 [tokens, active] and weight fp32 [tokens, active] from fp32 gate logits [tokens, experts]:
    top-`active` of sqrt(softplus(logits)) + bias, or the hash table's experts tid2eid[ids]."""
    P = ctypes.c_void_p
    return device.kernel("moe", "moe_route", declared("moe")).bind(-(-tokens // 8), 256, [
        P(idx), P(weight), P(logits), P(bias or 0), P(tid2eid or 0), P(ids or 0), ctypes.c_int(tokens),
        ctypes.c_int(experts), ctypes.c_int(active), ctypes.c_float(scaling)])


def check_layer(d: MoeDims, shared, bias: int | None, tid2eid: int | None, ids: int | None, multiple: int, why: str):
    """What every MoE here asks of a layer: routing within the kernels' limits, dim and inter multiples of
    `multiple` (`why`), a routed or a hash layer's inputs, the shared expert's weights with its inter."""
    if not 0 < d.active <= min(MAX_ACTIVE, d.experts) or d.experts > MAX_EXPERTS:
        raise ValueError(f"{d.active} of {d.experts} experts: at most {MAX_ACTIVE} of {MAX_EXPERTS}")
    if d.dim % multiple or d.inter % multiple:
        raise ValueError(f"dim and inter must be multiples of {multiple} ({why})")
    if (bias is None) == (tid2eid is None) or (tid2eid is not None and ids is None):
        raise ValueError("a routed layer gives bias, a hash layer tid2eid and ids")
    if bool(d.shared_inter) != (shared is not None):
        raise ValueError("shared_inter and the shared expert's weights go together")


def kernel(device: Device, expr: str):
    return device.kernel("moe", expr, declared("moe"))


def route_and_sort(device: Device, blas: Blas, dtype, d: MoeDims, at: dict[str, int], x: int, gate: int,
                   scaling: float, tile_rows: int, *, bias: int | None, tid2eid: int | None,
                   ids: int | None) -> list[Launch]:
    """Gate GEMM (fp32 logits), routing and the counting sort of the pairs by expert into `tile_rows`-row tiles,
    on the scratch arrays `at` of _layout's names."""
    P, I = ctypes.c_void_p, ctypes.c_int
    return [
        linear(blas, dtype, x, gate, at["logits"], d.tokens, d.experts, d.dim, np.float32),
        route(device, at["logits"], at["idx"], at["weight"], d.tokens, d.experts, d.active, scaling, bias=bias,
              tid2eid=tid2eid, ids=ids),
        kernel(device, "moe_sort").bind(1, 1024, [
            P(at["offsets"]), P(at["tile_offsets"]), P(at["perm"]), P(at["pos"]), P(at["idx"]), I(d.pairs),
            I(d.experts), I(tile_rows)]),
    ]


def swiglu(device: Device, dtype, h: int, g: int, u: int, rows: int, cols: int, limit: float, *,
           weight: int | None = None, perm: int | None = None, unweighted: int = 0) -> Launch:
    """h [rows, cols] (dtype) = the clamped SwiGLU of fp32 g, u [rows, cols]; with `weight`, rows from `unweighted`
    on are routed pairs in expert order, scaled by their routing weight (weight[perm[row - unweighted]])."""
    if (weight is None) != (perm is None):
        raise ValueError("routing weights come with the sort's perm")
    P = ctypes.c_void_p
    return kernel(device, f"swiglu<{storage_name(dtype)}>").bind(min(-(-rows * cols // 256), 4096), 256, [
        P(h), P(g), P(u), ctypes.c_longlong(rows * cols), ctypes.c_float(limit), P(weight or 0), P(perm or 0),
        ctypes.c_int(cols), ctypes.c_int(unweighted)])


def mma_fits(dtype, n: int, k: int) -> bool:
    """Whether moe_gemm_mma takes these operands: the bf16 build, n and k multiples of MMA_MULTIPLE."""
    return storage_name(dtype) == "__nv_bfloat16" and n % MMA_MULTIPLE == 0 and k % MMA_MULTIPLE == 0


def grouped_mma(device: Device, dtype, out: int, a: int, perm: int | None, active: int, weight: int | None,
                w_first: int, w_second: int | None, offsets: int, tile_offsets: int, experts: int, tiles: int,
                n: int, k: int, limit: float, *, wgmma: bool = False) -> Launch:
    """moe_gemm<bf16, 64, GATED>'s grouped GEMM on the tensor cores, GATED when w_second is given: out [rows, n] over
    the rows sorted by moe_sort into row tiles (`tiles` of them at most) of WGMMA_ROWS (wgmma, cuda_src/moe_wgmma.cu,
    sm_90a) or MMA_ROWS (mma.sync, cuda_src/moe_mma.cu)."""
    if not mma_fits(dtype, n, k):
        raise ValueError(f"the tensor-core grouped GEMM takes bf16 operands with n and k multiples of {MMA_MULTIPLE}, "
                         f"not {np.dtype(dtype)} with n {n}, k {k}")
    gated = w_second is not None
    if gated and (perm is None or weight is None):
        raise ValueError("the gated GEMM scales its rows by their routing weight[perm[row]]")
    P, I = ctypes.c_void_p, ctypes.c_int
    g = "true" if gated else "false"
    if wgmma:
        fn = device.kernel("moe_wgmma", f"moe_gemm_wgmma<{g}>", declared("moe_wgmma"))
        cols, threads, shared = WGMMA_COLS, WGMMA_THREADS, WGMMA_SHARED
    else:
        fn = device.kernel("moe_mma", f"moe_gemm_mma<{g}>", declared("moe_mma"))
        cols, threads, shared = MMA_COLS, 32 * MMA_WARPS, MMA_SHARED
    fn.allow_shared(shared)
    cols = cols // 2 if gated else cols
    return fn.bind((-(-n // cols), tiles), threads, [
        P(out), P(a), P(perm or 0), I(active), P(weight or 0), P(w_first), P(w_second or 0), P(offsets),
        P(tile_offsets), I(experts), I(n), I(k), ctypes.c_float(limit)], shared=shared)


def shared_expert(device: Device, blas: Blas, dtype, d: MoeDims, at: dict[str, int], x: int, shared: ExpertWeights,
                  limit: float) -> list[Launch]:
    """shared_out (fp32) = the shared expert of x through cuBLAS, on the scratch arrays `at`."""
    return [
        linear(blas, dtype, x, shared.w1, at["shared_g"], d.tokens, d.shared_inter, d.dim, np.float32),
        linear(blas, dtype, x, shared.w3, at["shared_u"], d.tokens, d.shared_inter, d.dim, np.float32),
        swiglu(device, dtype, at["shared_h"], at["shared_g"], at["shared_u"], d.tokens, d.shared_inter, limit),
        linear(blas, dtype, at["shared_h"], shared.w2, at["shared_out"], d.tokens, d.dim, d.shared_inter, np.float32),
    ]

def combine(device: Device, dtype, d: MoeDims, at: dict[str, int], y: int, shared: bool) -> Launch:
    """y = Σ_slot expert_out (+ shared_out) on the scratch arrays `at`: the expert rows carry their weights."""
    P, I = ctypes.c_void_p, ctypes.c_int
    return kernel(device, f"moe_combine<{storage_name(dtype)}>").bind(d.tokens, 256, [
        P(y), P(at["expert_out"]), P(at["shared_out"] if shared else 0), P(at["pos"]), I(d.active), I(d.dim)])


@dataclass(frozen=True)
class ExpertWeights:
    """Device addresses. Routed experts: pointer tables [experts] of w1 [inter, dim], w3 [inter, dim],
    w2 [dim, inter]; shared expert: the matrices themselves."""
    w1: int
    w3: int
    w2: int


class MoE:
    """y [tokens, dim] = Σ_slot w2(w·h(x)) + shared(x) for x [tokens, dim] (storage dtype).
    Routed layers give `bias` (fp32 [experts]); hash layers give `tid2eid` (int32 [vocab, active]) and
    `ids` (int32 [tokens]). `gate` is [experts, dim] in the storage dtype. `workspace` holds
    workspace_bytes(dims, dtype) bytes; layers run one after another can share one."""

    def __init__(self, device: Device, blas: Blas, dtype, dims: MoeDims, *, x: int, y: int, gate: int,
                 routed: ExpertWeights, shared: ExpertWeights | None, scaling: float, limit: float,
                 workspace: int, bias: int | None = None, tid2eid: int | None = None, ids: int | None = None,
                 path: str | None = None):
        d = dims
        check_layer(d, shared, bias, tid2eid, ids, 8, "16-byte vectors")
        t = storage_name(dtype)
        at = {k: workspace + v for k, v in _layout(d, dtype).items()}
        self.dims, self.scratch = d, at
        self.path = path or grouped_path(device.arch, dtype, d)
        self.tile_rows = bm = PATH_TILE_ROWS[self.path]
        max_tiles = d.max_tiles(bm)
        P, I, V = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
        launches = route_and_sort(device, blas, dtype, d, at, x, gate, scaling, bm, bias=bias, tid2eid=tid2eid,
                                  ids=ids)
        # The skinny kernel carries the shared expert as row tiles of its own when its shapes match.
        fold = self.path == "skinny" and shared is not None and d.shared_inter == d.inter
        if self.path == "skinny":
            s_rows = d.tokens if fold else 0
            tiles = max_tiles + -(-s_rows // SKINNY_ROWS)
            s1, s3, s2 = (shared.w1, shared.w3, shared.w2) if fold else (0, 0, 0)
            self.grouped = [
                kernel(device, f"moe_skinny<{t},true>").bind(
                    (-(-d.inter // (SKINNY_WARPS * SKINNY_W // 2)), tiles), 32 * SKINNY_WARPS, [
                    P(at["hidden"]), P(x), P(at["perm"]), I(d.active), P(at["weight"]), P(routed.w1), P(routed.w3),
                    P(at["offsets"]), P(at["tile_offsets"]), I(d.experts), I(max_tiles), P(at["shared_h"]), P(x),
                    P(s1), P(s3), I(s_rows), I(d.inter), I(d.dim), V(limit)]),
                kernel(device, f"moe_skinny<{t},false>").bind(
                    (-(-d.dim // (SKINNY_WARPS * SKINNY_W)), tiles), 32 * SKINNY_WARPS, [
                    P(at["expert_out"]), P(at["hidden"]), P(0), I(d.active), P(0), P(routed.w2), P(0),
                    P(at["offsets"]), P(at["tile_offsets"]), I(d.experts), I(max_tiles), P(at["shared_out"]),
                    P(at["shared_h"]), P(s2), P(0), I(s_rows), I(d.dim), I(d.inter), V(limit)]),
            ]
        elif self.path in ("wgmma", "mma"):
            common = dict(offsets=at["offsets"], tile_offsets=at["tile_offsets"], experts=d.experts,
                          tiles=max_tiles, limit=limit, wgmma=self.path == "wgmma")
            self.grouped = [
                grouped_mma(device, dtype, at["hidden"], x, at["perm"], d.active, at["weight"], routed.w1, routed.w3,
                            n=d.inter, k=d.dim, **common),
                grouped_mma(device, dtype, at["expert_out"], at["hidden"], None, d.active, None, routed.w2, None,
                            n=d.dim, k=d.inter, **common),
            ]
        else:
            self.grouped = [
                kernel(device, f"moe_gemm<{t},{bm},true>").bind((-(-d.inter // TILE_N), max_tiles),
                                                                GEMM_THREADS, [
                    P(at["hidden"]), P(x), P(at["perm"]), I(d.active), P(at["weight"]), P(routed.w1), P(routed.w3),
                    P(at["offsets"]), P(at["tile_offsets"]), I(d.experts), I(d.inter), I(d.dim), V(limit)]),
                kernel(device, f"moe_gemm<{t},{bm},false>").bind((-(-d.dim // TILE_N), max_tiles),
                                                                 GEMM_THREADS, [
                    P(at["expert_out"]), P(at["hidden"]), P(0), I(d.active), P(0), P(routed.w2), P(0),
                    P(at["offsets"]), P(at["tile_offsets"]), I(d.experts), I(d.dim), I(d.inter), V(limit)]),
            ]
        launches += self.grouped
        if shared is not None and not fold:
            launches += shared_expert(device, blas, dtype, d, at, x, shared, limit)
        launches.append(combine(device, dtype, d, at, y, shared is not None))
        self.launches = launches if d.tokens else []

    def __call__(self, stream):
        for launch in self.launches:
            launch(stream)

