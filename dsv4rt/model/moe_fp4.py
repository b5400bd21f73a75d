"""The faithful decode MoE on the experts as released (docs/model.md#moe, docs/formats.md#storage-formats; twin: reference.moe.MoE with
act_quant in front of every expert GEMM): routed experts in packed e2m1 with e8m0 scales per 1 x 32
(cuda_src/moe_fp4.cu), the shared expert in e4m3 with e8m0 scales per 128 x 128 (fp8.skinny_gemm). One bound
sequence without host synchronisation, as moe.MoE, whose routing, sort, SwiGLU and combine kernels it runs:
gate GEMM → routing → counting sort into 8-row tiles → act_quant(x) → routed w1/w3 (fp4) and shared w1/w3 (fp8)
into fp32 g, u → clamped SwiGLU over all rows, routed rows times their routing weight → act_quant(h) → routed w2
(fp4), shared w2 (fp8) → the sum of each token's rows. Each 8-row tile reads its expert's weights once: meant for decode.
Batches whose experts see more rows (`fp4_path`) run the routed experts on the fp8 tensor cores instead
(cuda_src/moe_wgmma_fp8.cu): act_quant's e4m3 x against the e2m1 weights re-expressed in e4m3 in shared memory as the
decode kernel does, the float32 SwiGLU output act_quant-ed for w2, and the shared expert on the prefill fp8 GEMM
(gemm_fp8)."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from ..cuda.build import declared
from ..cuda.device import Device, Launch
from ..cuda.ops import storage_name
from .paged import NOTHING
from . import fp8, gemm_fp8
from .gemm import Blas
from .moe import WGMMA_ROWS, MoeDims, check_layer, combine, grouped_path, packed_offsets, route_and_sort, swiglu

TILE_ROWS = 8       # kFp4Rows: activation rows of a tile
TILE_COLUMNS = 16   # output columns of a block
BLOCK = 32          # kFp4Block: columns per weight scale
MAX_WARPS = 8       # kFp4MaxWarps
IN_FLIGHT = 4       # kFp4InFlight: 16-byte weight vectors per row pair a thread loads before it computes
# moe_wgmma_fp8.cu's kF8Cols (weight rows a block; GATED: half of them w1), kF8Threads, kF8Stages, kF8Producers and
# kF8Shared: stages of kF8Rows a rows and as many widened weight rows of 128 bytes, the packed rows, a scale word for
# each producer thread and an exponent per weight row, then the alignment slack and two mbarriers a stage. n and k
# must be multiples of kF8K.
FP8_COLS, FP8_THREADS, FP8_MULTIPLE, FP8_STAGES, FP8_PRODUCERS = 128, 512, 128, 4, 256
_F8_STAGE = WGMMA_ROWS * 128 + FP8_COLS * (128 + 64 + 4) + FP8_PRODUCERS * 4
FP8_SHARED = FP8_STAGES * -(-_F8_STAGE // 1024) * 1024 + 1024 + 16 * FP8_STAGES


@dataclass(frozen=True)
class ScaledWeights:
    """Device addresses of w1, w3 [inter, dim], w2 [dim, inter] and of their e8m0 scales, as the checkpoint
    stores them."""
    w1: int
    w3: int
    w2: int
    w1_scale: int
    w3_scale: int
    w2_scale: int


class Fp4Experts(ScaledWeights):
    """Pointer tables [experts] (moe.pointer_table) of the routed experts' packed e2m1 weights, w1 and w3
    [inter, dim/2], w2 [dim, inter/2], and of their e8m0 scales [rows, cols/32]."""


class Fp8Expert(ScaledWeights):
    """The shared expert: e4m3 w1, w3 [inter, dim], w2 [dim, inter] and e8m0 scales per 128 x 128 tile."""



def fp4_path(arch: str | None, dtype, d: MoeDims) -> str:
    """"wgmma" where moe.grouped_path takes it and the widths are multiples of 128 (a scale word a step), else
    "skinny"."""
    wide = d.dim % 128 == 0 and d.inter % 128 == 0
    return "wgmma" if wide and grouped_path(arch, dtype, d) == "wgmma" else "skinny"


def gemm_warps(k: int, matrices: int) -> int:
    """Warps of a block, which split its 128-column groups: each loads IN_FLIGHT / matrices groups at once and
    goes round about twice (Flash: w1/w3 k 4096 → 8 warps, w2 k 2048 → 2)."""
    groups = fp8.scale_columns(k)
    return max(1, min(MAX_WARPS, -(-groups // (2 * (IN_FLIGHT // matrices)))))


def expert_gemm(device: Device, out_dtype, out: int, xq: int, x_scale: int, w: int, w_scale: int, offsets: int,
                tile_offsets: int, experts: int, tiles: int, n: int, k: int, *, perm: int | None = None,
                active: int = 1, out_second: int | None = None, w_second: int | None = None,
                w_second_scale: int | None = None) -> Launch:
    """out [rows, n] = dequant(xq, x_scale) · dequant(W_e)ᵀ for each expert e's sorted rows (offsets, tile_offsets
    from moe_sort with TILE_ROWS-row tiles; `tiles` an upper bound of their total). xq [., k] e4m3 and x_scale
    [., ceil(k/128)] e8m0 from act_quant, read at row perm[r] / active when perm is given, else at r. w and
    w_scale: pointer tables of packed e2m1 [n, k/2] and e8m0 [n, k/32]; a second pair writes out_second. fp32
    accumulation; out float32 or bfloat16. k must be a multiple of 32, xq and the weights 16-byte aligned."""
    if k % BLOCK:
        raise ValueError(f"the fp4 expert GEMM needs k to be a multiple of {BLOCK}, got {k}")
    if (out_second is None) != (w_second is None) or (w_second is None) != (w_second_scale is None):
        raise ValueError("a second weight comes with its scales and its output")
    if not tiles or not n:
        return NOTHING
    m = 1 if w_second is None else 2
    kernel = device.kernel("moe_fp4", f"moe_fp4_skinny<{storage_name(out_dtype)},{m}>", declared("moe_fp4"))
    P = ctypes.c_void_p
    args = [P(out), P(out_second or 0), P(xq), P(x_scale), P(perm or 0), ctypes.c_int(active), P(w), P(w_scale),
            P(w_second or 0), P(w_second_scale or 0), P(offsets), P(tile_offsets), ctypes.c_int(experts),
            ctypes.c_int(n), ctypes.c_int(k)]
    return kernel.bind((-(-n // TILE_COLUMNS), tiles), 32 * gemm_warps(k, m), args)


def fp8_experts(device: Device, out: int, a: int, a_scale: int, first: tuple[int, int],
                second: tuple[int, int] | None = None, *, n: int, k: int, offsets: int, tile_offsets: int,
                experts: int, tiles: int, perm: int | None = None, active: int = 1, weight: int | None = None,
                limit: float = 0.0) -> Launch:
    """The routed experts of many-row batches on the fp8 tensor cores (cuda_src/moe_wgmma_fp8.cu, sm_90a): out [rows, n]
    over the rows sorted by moe_sort into WGMMA_ROWS-row tiles (`tiles` at most). a [., k] e4m3 and a_scale from
    act_quant, read at row perm[r] / active when perm is given. first, second: pointer tables of packed e2m1 weights
    [n, k/2] and of their e8m0 scales [n, k/32]; with a second the output is float32, the clamped SwiGLU of the two
    times the row's routing weight[perm[row]], else bf16. n and k must be multiples of 128."""
    gated = second is not None
    if n % FP8_MULTIPLE or k % FP8_MULTIPLE:
        raise ValueError(f"the fp8 expert GEMM needs n and k multiples of {FP8_MULTIPLE}, got n {n}, k {k}")
    if gated and (perm is None or weight is None):
        raise ValueError("the gated GEMM scales its rows by their routing weight[perm[row]]")
    if not tiles or not n:
        return NOTHING
    fn = device.kernel("moe_wgmma_fp8", f"moe_fp8_wgmma<{'true' if gated else 'false'}>", declared("moe_wgmma_fp8"))
    fn.allow_shared(FP8_SHARED)
    P, I = ctypes.c_void_p, ctypes.c_int
    (w1, s1), (w3, s3) = first, second or (0, 0)
    return fn.bind((-(-n // (FP8_COLS // 2 if gated else FP8_COLS)), tiles), FP8_THREADS, [
        P(out), P(a), P(a_scale), P(perm or 0), I(active), P(weight or 0), P(w1), P(w3), P(s1), P(s3), P(offsets),
        P(tile_offsets), I(experts), I(n), I(k), ctypes.c_float(limit)], shared=FP8_SHARED)


def _layout(d: MoeDims, dtype) -> dict[str, int]:
    """Byte offsets of the scratch arrays. Rows of g, u, hidden and their quantised hq, hs: the shared expert's
    `tokens` first (when there is one), then the routed pairs in expert order."""
    t, f4, i4 = np.dtype(dtype).itemsize, 4, 4
    rows = d.pairs + (d.tokens if d.shared_inter else 0)
    sizes = dict(logits=d.tokens * d.experts * f4, idx=d.pairs * i4, weight=d.pairs * f4,
                 offsets=(d.experts + 1) * i4, tile_offsets=(d.experts + 1) * i4, perm=d.pairs * i4, pos=d.pairs * i4,
                 xq=d.tokens * d.dim, xs=d.tokens * fp8.scale_columns(d.dim), g=rows * d.inter * f4,
                 u=rows * d.inter * f4, hidden=rows * d.inter * f4, hq=rows * d.inter,
                 hs=rows * fp8.scale_columns(d.inter), expert_out=d.pairs * d.dim * t,
                 shared_out=d.tokens * d.dim * f4 if d.shared_inter else 0)
    return packed_offsets(sizes)


def workspace_bytes(dims: MoeDims, dtype) -> int:
    return _layout(dims, dtype)["total"]


class Fp4MoE:
    """moe.MoE's y [tokens, dim] = Σ_slot w2(w·h(x)) + shared(x) on the released expert formats, with the
    faithful activation quantisation. x, y, gate (bf16 or float32 [experts, dim]), bias / tid2eid / ids as in
    moe.MoE; `workspace` holds workspace_bytes(dims, dtype) bytes. The shared expert, when there is one, has the
    routed experts' inter (dims.shared_inter == dims.inter). x_quantized = (xq, xs): act_quant(x) is already there
    (e4m3 [tokens, dim], e8m0 [tokens, dim / 128]), written by an earlier launch on the stream."""

    def __init__(self, device: Device, blas: Blas, dtype, dims: MoeDims, *, x: int, y: int, gate: int,
                 routed: Fp4Experts, shared: Fp8Expert | None, scaling: float, limit: float, workspace: int,
                 bias: int | None = None, tid2eid: int | None = None, ids: int | None = None, path: str | None = None,
                 x_quantized: tuple[int, int] | None = None):
        d = dims
        check_layer(d, shared, bias, tid2eid, ids, BLOCK, "packed e2m1 rows of 16-byte vectors")
        if d.shared_inter not in (0, d.inter):
            raise ValueError(f"the shared expert's inter {d.shared_inter} differs from the routed {d.inter}")
        at = {k: workspace + v for k, v in _layout(d, dtype).items()}
        quantise_x = x_quantized is None
        if not quantise_x:   # act_quant(x) left by an earlier launch (hc.pre's, with the norm)
            at["xq"], at["xs"] = x_quantized
        self.dims, self.scratch = d, at
        self.path = path or fp4_path(device.arch, dtype, d)
        if self.path == "wgmma" and storage_name(dtype) != "__nv_bfloat16":
            raise ValueError("the fp8 expert GEMMs write bf16 rows: the wgmma path needs the bf16 build")
        self.tile_rows = WGMMA_ROWS if self.path == "wgmma" else TILE_ROWS
        launches = route_and_sort(device, blas, dtype, d, at, x, gate, scaling, self.tile_rows, bias=bias,
                                  tid2eid=tid2eid, ids=ids)
        if quantise_x:
            launches.append(fp8.act_quant(device, dtype, at["xq"], at["xs"], x, d.tokens, d.dim))
        launches += (self._wgmma if self.path == "wgmma" else self._skinny)(device, dtype, d, at, routed, shared, limit)
        launches.append(combine(device, dtype, d, at, y, shared is not None))
        self.launches = launches if d.tokens else []

    @staticmethod
    def _skinny(device, dtype, d, at, routed, shared, limit) -> list[Launch]:
        F, D, T = d.inter, d.dim, d.tokens
        s_rows = T if shared is not None else 0
        rows = s_rows + d.pairs
        tiles = d.max_tiles(TILE_ROWS)
        launches = [
            expert_gemm(device, np.float32, at["g"] + 4 * s_rows * F, at["xq"], at["xs"], routed.w1, routed.w1_scale,
                        at["offsets"], at["tile_offsets"], d.experts, tiles, F, D, perm=at["perm"], active=d.active,
                        out_second=at["u"] + 4 * s_rows * F, w_second=routed.w3, w_second_scale=routed.w3_scale),
        ]
        if shared is not None:
            launches += [fp8.skinny_gemm(device, np.float32, at[out], at["xq"], at["xs"], w, s, T, F, D)
                         for out, w, s in (("g", shared.w1, shared.w1_scale), ("u", shared.w3, shared.w3_scale))]
        launches += [
            swiglu(device, np.float32, at["hidden"], at["g"], at["u"], rows, F, limit, weight=at["weight"],
                   perm=at["perm"], unweighted=s_rows),
            fp8.act_quant(device, np.float32, at["hq"], at["hs"], at["hidden"], rows, F),
            expert_gemm(device, dtype, at["expert_out"], at["hq"] + s_rows * F,
                        at["hs"] + s_rows * fp8.scale_columns(F), routed.w2, routed.w2_scale, at["offsets"],
                        at["tile_offsets"], d.experts, tiles, D, F),
        ]
        if shared is not None:
            launches.append(fp8.skinny_gemm(device, np.float32, at["shared_out"], at["hq"], at["hs"], shared.w2,
                                            shared.w2_scale, T, D, F))
        return launches

    @staticmethod
    def _wgmma(device, dtype, d, at, routed, shared, limit) -> list[Launch]:
        F, D, T = d.inter, d.dim, d.tokens
        s_rows = T if shared is not None else 0
        # the shared expert's SwiGLU rows first, then the routed rows: one act_quant over both, as _skinny's
        common = dict(offsets=at["offsets"], tile_offsets=at["tile_offsets"], experts=d.experts,
                      tiles=d.max_tiles(WGMMA_ROWS))
        launches = []
        if shared is not None:
            launches += [
                gemm_fp8.fp8_gemm(device, at["xq"], at["xs"], shared.w1, shared.w1_scale, at["g"], T, F, D, np.float32),
                gemm_fp8.fp8_gemm(device, at["xq"], at["xs"], shared.w3, shared.w3_scale, at["u"], T, F, D, np.float32),
                swiglu(device, np.float32, at["hidden"], at["g"], at["u"], T, F, limit),
            ]
        launches += [
            fp8_experts(device, at["hidden"] + 4 * s_rows * F, at["xq"], at["xs"], (routed.w1, routed.w1_scale),
                        (routed.w3, routed.w3_scale), n=F, k=D, perm=at["perm"], active=d.active,
                        weight=at["weight"], limit=limit, **common),
            fp8.act_quant(device, np.float32, at["hq"], at["hs"], at["hidden"], s_rows + d.pairs, F),
            fp8_experts(device, at["expert_out"], at["hq"] + s_rows * F, at["hs"] + s_rows * fp8.scale_columns(F),
                        (routed.w2, routed.w2_scale), n=D, k=F, **common),
        ]
        if shared is not None:
            launches.append(gemm_fp8.fp8_gemm(device, at["hq"], at["hs"], shared.w2, shared.w2_scale, at["shared_out"],
                                              T, D, F, np.float32))
        return launches

    def __call__(self, stream):
        for launch in self.launches:
            launch(stream)
