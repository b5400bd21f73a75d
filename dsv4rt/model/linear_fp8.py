"""The faithful-mode linear layer of a weight stored in fp8 (docs/numerics.md#act-quant; twin: reference.ops.Linear with
act_quant on the dequantised weight): act_quant of the input, then the fp8 GEMM on the checkpoint's e4m3 weight
and e8m0 block scales. Decode batches, shapes off the 128 grid and float32 outputs take fp8.skinny_gemm; bf16
prefill batches on sm_90a the wgmma kernel of gemm_fp8.

Also which weights the faithful GPU build reads as stored (released_formats)."""
from __future__ import annotations

import re

import numpy as np

from ..cuda.build import WGMMA_ARCH
from ..cuda.device import Device, Launch
from ..loader import Checkpoint, expected_shapes
from . import fp8, gemm_fp8
from .paged import LaunchSequence

SKINNY_ROWS = 16      # fp8.skinny_gemm reads the weight once for up to 16 rows
_ATTENTION = re.compile(r"\.attn\.(wq_a|wq_b|wkv|wo_b|indexer\.wq_b)\.weight$")
_ROUTED = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
_SHARED = re.compile(r"\.ffn\.shared_experts\.w[123]\.weight$")
_OUTPUT = re.compile(r"\.attn\.wo_a\.weight$")   # fp8 as released; its input quantised in fast numerics only


def fp8_gemm(device: Device, out_dtype, y: int, xq: int, xs: int, w: int, w_scale: int, m: int, n: int,
             k: int, group_n: int | None = None) -> Launch:
    """y [m, n] = dequant(xq, xs) · dequant(w, w_scale)ᵀ (operands and group_n as fp8.skinny_gemm takes them).
    Hopper's e4m3 tensor cores keep 13 mantissa bits of each wgmma's sum (as in the official code's own fp8 GEMM):
    a 128-column block comes out ~4e-4 off, below a bf16 output's rounding but enough to flip later act_quant
    roundings of a float32 build, whose layers match the reference's fp32 sums to 1e-4 only on the CUDA cores."""
    group_n = group_n or n
    tiled = group_n % gemm_fp8.TILE_N == 0 and k % fp8.BLOCK == 0 and device.arch == WGMMA_ARCH
    if m > SKINNY_ROWS and tiled and np.dtype(out_dtype) != np.float32:
        return gemm_fp8.fp8_gemm(device, xq, xs, w, w_scale, y, m, n, k, out_dtype, group_n=group_n)
    return fp8.skinny_gemm(device, out_dtype, y, xq, xs, w, w_scale, m, n, k, group_n=group_n)


def linear_fp8(device: Device, dtype, x: int, w: int, w_scale: int, y: int, m: int, n: int, k: int, *, xq: int,
               xs: int, quantized: bool = False, group_n: int | None = None) -> LaunchSequence:
    """y [m, n] (dtype) = act_quant(x [m, k], dtype) · dequant(w, w_scale)ᵀ as one call. xq [m, k] and
    xs [m, ceil(k/128)] (bytes) receive x's quantised form; quantized: an earlier launch on the same stream left
    it there already (an input that feeds two GEMMs). group_n (the grouped output projection, as
    fp8.skinny_gemm): x is [m, g·k] for g = n / group_n groups, quantised as m·g rows of k."""
    group_n = group_n or n
    rows = m * (n // group_n)
    gemm = fp8_gemm(device, dtype, y, xq, xs, w, w_scale, m, n, k, group_n)
    return LaunchSequence(gemm) if quantized else \
        LaunchSequence(fp8.act_quant(device, dtype, xq, xs, x, rows, k), gemm)


def released_formats(ck: Checkpoint) -> tuple[bool, bool]:
    """(attention fp8, experts quantised): whether the attention GEMMs that the official code quantises (wq_a,
    wq_b, wkv, wo_b, indexer.wq_b) are all stored in fp8, and whether the routed experts are all packed fp4 with
    the shared expert in fp8, as released. Either group may also be stored unquantised (act_quant then does not
    apply, as in the reference); any other mix, or any other quantised weight, has no kernel here. wo_a may be
    stored in fp8 (as released) or unquantised, layer by layer."""
    names = list(expected_shapes(ck.config))

    def stored(pattern) -> set:
        return {ck.quant_format(n) for n in names if pattern.search(n)}

    attention, routed, shared = stored(_ATTENTION), stored(_ROUTED), stored(_SHARED)
    others = sorted(n for n in names if ck.is_quantized(n) and (ck.quant_format(n) != "fp8" or not _OUTPUT.search(n))
                    and not any(p.search(n) for p in (_ATTENTION, _ROUTED, _SHARED)))
    experts = (routed, shared or {None})
    if attention not in ({None}, {"fp8"}) or experts not in (({None}, {None}), ({"fp4"}, {"fp8"})) or others:
        detail = f"{others[0]} is stored quantised" if others else \
            f"attention {_formats(attention)}, routed experts {_formats(routed)}, shared expert {_formats(shared)}"
        raise ValueError(f"faithful numerics on the GPU take the released formats (fp8 attention GEMMs, fp4 routed "
                         f"and fp8 shared experts) or unquantised weights; this checkpoint has {detail}")
    return attention == {"fp8"}, routed == {"fp4"}


def _formats(found: set) -> str:
    return "/".join(sorted(f or "unquantised" for f in found)) or "none"
