"""Launchers for cuda_src/hc.cu: embedding into streams and the mHC pre/post/head (docs/model.md#hyper-connections).

Streams X are [T, hc, D] in the storage dtype; fn, base, scale, post and comb are float32.
An empty batch (tokens == 0) gives a launch that does nothing.
"""
from __future__ import annotations

import ctypes

import numpy as np

from dsv4rt.cuda.build import declared
from dsv4rt.cuda.device import Device, Launch
from dsv4rt.cuda import ops
from dsv4rt.cuda.ops import storage_name
from dsv4rt.model import fp8
from dsv4rt.model.paged import NOTHING, LaunchSequence

HCS = (2, 4)    # the hc_mult values instantiated in hc.cu
THREADS = 256   # kHcThreads
TOK = 4         # kHcTok: tokens per thread group in hc_pre / hc_head
DECODE_THREADS = 288  # kPreThreads of hc_pre_decode
DECODE_TOKENS = (1, 8, 16)  # its instantiated token groups
DECODE_BLOCKS = 128   # the blocks it aims for: one a SM, all resident at once (H200: 132 SMs)
SLICE_UNIT = 128      # columns of one 32-lane step of four; slices are multiples of it
COUNTER_BYTES = 256   # hc_pre_decode's two counters, at the start of its workspace
PROJECT_TOKENS = 64   # kPmTokens of hc_mma.cu: tokens of a hc_project_mma block
PROJECT_K = 64        # kPmK: columns of its k tiles; hc·D must be a multiple
PROJECT_STAGES = 4    # kPmStages
PROJECT_THREADS = 128  # kPmThreads
PROJECT_BLOCKS = 264  # the blocks it aims for (two an H200 SM) by splitting the columns of short steps into slices



def _kernel(device: Device, name: str, dtype, hc: int | None = None, tokens: int | None = None):
    if hc is not None and hc not in HCS:
        raise ValueError(f"no hyper-connection kernels for hc={hc} (built for {HCS})")
    params = ",".join(str(p) for p in (storage_name(dtype), hc, tokens) if p is not None)
    return device.kernel("hc", f"{name}<{params}>", declared("hc"))



def _block_1d(elements: int, cap: int) -> int:
    return min(cap, max(32, (elements + 31) // 32 * 32))


def _groups(device: Device, tokens: int) -> int:
    """Token groups per block. Eight one-warp groups share each fn tile through shared memory (32 tokens a
    block), which pays once every SM gets a block; shorter batches take one group of 256 lanes per block
    of kHcTok tokens, each block reading all of fn from L2 (H200, bf16 Flash: 4224 tokens 217 us tiled,
    4192 tokens 253 us direct; 8192 tokens 440 us, 1024 tokens 74 us, 1 token 33 us)."""
    return 8 if -(-tokens // (8 * TOK)) >= device.sm_count else 1


def _vec(dtype) -> int:
    return 16 // np.dtype(dtype).itemsize


def _p(*ptrs):
    return [ctypes.c_void_p(p) for p in ptrs]


def embed(device: Device, dtype, out: int, ids: int, table: int, tokens: int, vocab: int, hc: int,
          dim: int) -> Launch:
    """out [T, hc, D] = table[ids] in every stream; ids int32 [T], ids outside [0, vocab) give zero rows."""
    if tokens == 0:
        return NOTHING
    k = _kernel(device, "hc_embed", dtype)
    args = _p(out, ids, table) + [ctypes.c_int(vocab), ctypes.c_int(hc), ctypes.c_int(dim)]
    return k.bind(tokens, _block_1d(-(-dim // _vec(dtype)), 256), args)


def _decode_grid(tokens: int, hc: int, dim: int) -> tuple[int, int, int, int]:
    """(tokens per group, groups, slices, columns per slice) of hc_pre_decode: blocks = groups × slices, about
    DECODE_BLOCKS of them, each one slice of the hc·D columns for one group."""
    group = next(n for n in DECODE_TOKENS if n >= min(tokens, DECODE_TOKENS[-1]))
    groups = -(-tokens // group)
    units = -(-(hc * dim) // SLICE_UNIT)
    per_slice = -(-units // max(1, DECODE_BLOCKS // groups))
    return group, groups, -(-units // per_slice), per_slice * SLICE_UNIT


def _partial_bytes(tokens: int, hc: int, dim: int) -> int:
    return tokens * _decode_grid(tokens, hc, dim)[2] * ((2 + hc) * hc + 1) * 4


def _project_grid(tokens: int, hc: int, dim: int) -> tuple[int, int, int]:
    """(blocks of tokens, slices, k tiles a slice) of hc_project_mma: about PROJECT_BLOCKS blocks in all."""
    blocks, tiles = -(-tokens // PROJECT_TOKENS), hc * dim // PROJECT_K
    per_slice = -(-tiles // min(tiles, -(-PROJECT_BLOCKS // blocks)))
    return blocks, -(-tiles // per_slice), per_slice


def _project_rows(tokens: int, hc: int, dim: int) -> int:
    """A bound on tokens × slices of hc_project_mma for every batch of up to `tokens` tokens: a batch of b blocks
    takes at most ceil(PROJECT_BLOCKS / b) slices."""
    return min(tokens * max(1, hc * dim // PROJECT_K), tokens + PROJECT_BLOCKS * PROJECT_TOKENS)


def pre_workspace_bytes(tokens: int, hc: int, dim: int) -> int:
    """Bytes of the workspace `pre` needs for batches of up to `tokens` tokens. Zero it once before the first
    launch (two counters that every launch leaves at zero again); launches that share it must not overlap."""
    decode = max((_partial_bytes(t, hc, dim) for t in range(1, tokens + 1)), default=0)
    return COUNTER_BYTES + max(decode, _project_rows(tokens, hc, dim) * ((2 + hc) * hc + 1) * 4)


def projects_on_mma(dtype, hc: int, dim: int) -> bool:
    """Whether `pre` takes hc_project_mma and hc_pre_finish beyond decode batches: bf16 streams (exact as the
    tensor cores' operand) whose hc·D columns make whole k tiles."""
    return storage_name(dtype) == "__nv_bfloat16" and (hc * dim) % PROJECT_K == 0


def decode_tokens(sm_count: int) -> int:
    """The largest batch `pre` takes hc_pre_decode for (and so can fuse the previous post into), on a device of
    `sm_count` SMs."""
    return TOK * sm_count


def pre(device: Device, dtype, u: int, post: int, comb: int, x: int, fn: int, base: int, scale: int,
        tokens: int, hc: int, dim: int, eps: float, hc_eps: float, iters: int, *, xn: int = 0, norm: int = 0,
        norm_eps: float = 0.0, workspace: int = 0, fused_post: tuple[int, int, int, int] | None = None,
        xq: int = 0, xs: int = 0) -> Launch | LaunchSequence:
    """u [T, D] = Σ_j pre_j X_j, post [T, hc], comb [T, hc, hc] from streams x [T, hc, D];
    fn [(2+hc)·hc, hc·D], base [(2+hc)·hc], scale [3]. With xn also xn [T, D] = RMSNorm(u) · norm
    (float32 [D]), inside the decode kernel or as a second launch; with xq, xs also act_quant(xn) as fp8.act_quant
    writes it (e4m3 [T, D], e8m0 [T, ceil(D / 128)]), inside the finish of bf16 prefill steps (D a multiple of
    128) or as a launch after. Decode batches need `workspace`:
    pre_workspace_bytes(tokens, hc, dim) bytes or more, zeroed before its first use.
    fused_post = (x_prev, f, post_prev, comb_prev), decode batches only: first x = post(x_prev, f, post_prev,
    comb_prev) (what `post` would write), bit for bit, in the same launch. Out of place: x_prev is not x, and post,
    comb are not post_prev, comb_prev (blocks still read the old ones while others write)."""
    if fused_post is not None:
        x_prev, _, post_prev, comb_prev = fused_post
        most = decode_tokens(device.sm_count)
        if tokens > most:
            raise ValueError(f"fused_post needs a decode batch (at most {most} tokens), got {tokens}")
        if x_prev == x or post_prev == post or comb_prev == comb:
            raise ValueError("fused_post's streams, post and comb must be other buffers than x, post and comb")
    if xq and not (xn and xs):
        raise ValueError("act_quant of the normed input (xq, xs) needs xn")
    if tokens == 0:
        return NOTHING
    def quantise() -> list[Launch]:
        return [fp8.act_quant(device, dtype, xq, xs, xn, tokens, dim)] if xq else []
    args = _p(u, post, comb, x, fn, base, scale) + [ctypes.c_int(tokens), ctypes.c_int(dim), ctypes.c_float(eps),
                                                    ctypes.c_float(hc_eps), ctypes.c_int(iters)]
    if tokens <= decode_tokens(device.sm_count):
        # Decode: a block per TOK tokens would read all of fn (1.5 MB at Flash sizes) alone; about DECODE_BLOCKS
        # blocks share it instead, a slice each, and the last to finish theirs finish the tokens. Finishers wait for
        # the others, so fewer of them than SMs keeps an SM free for any block yet to start (H200, bf16 Flash,
        # the cluster kernel this replaced: 16 us a launch at 1 token in ncu, 20 us at 64).
        if not workspace:
            raise ValueError("decode batches need a workspace of pre_workspace_bytes(tokens, hc, dim) bytes")
        group, groups, slices, cols = _decode_grid(tokens, hc, dim)
        finishers = min(tokens, groups * slices, device.sm_count - 1)
        args += [*_p(xn, norm), ctypes.c_float(norm_eps), *_p(workspace, workspace + COUNTER_BYTES),
                 ctypes.c_int(cols), ctypes.c_int(finishers), *_p(*(fused_post or (0, 0, 0, 0)))]
        launch = _kernel(device, "hc_pre_decode", dtype, hc, group).bind((slices, groups), DECODE_THREADS, args)
        return LaunchSequence(launch, *quantise()) if xq else launch
    if projects_on_mma(dtype, hc, dim) and x % 16 == 0 and fn % 16 == 0:   # cp.async of 16 bytes
        # The projections on the tensor cores, the rest (Sinkhorn, u, the norm) one token a block as the decode
        # finishers do it; the CUDA-core projection below reads the streams twice and holds 32 tokens a block.
        if not workspace:
            raise ValueError("steps on the tensor cores need a workspace of pre_workspace_bytes(tokens, hc, dim) bytes")
        blocks, slices, per_slice = _project_grid(tokens, hc, dim)
        partial = workspace + COUNTER_BYTES
        r = (2 + hc) * hc
        shared = PROJECT_STAGES * (PROJECT_TOKENS * PROJECT_K * 2 + r * (PROJECT_K + 8) * 4)
        project = device.kernel("hc_mma", f"hc_project_mma<{hc}>", declared("hc_mma"))
        project.allow_shared(shared)
        inside = (xq and xq % 8 == 0 and dim % fp8.BLOCK == 0       # chunked rows, 8-byte code stores
                  and all(p % 16 == 0 for p in (x, u, xn, norm)))
        finish = _kernel(device, "hc_pre_finish", dtype, hc).bind(tokens, DECODE_THREADS, [
            *_p(u, post, comb, x, base, scale), ctypes.c_int(dim), ctypes.c_float(eps), ctypes.c_float(hc_eps),
            ctypes.c_int(iters), *_p(xn, norm), ctypes.c_float(norm_eps), *_p(partial), ctypes.c_int(slices),
            *(_p(xq, xs) if inside else _p(0, 0))])
        return LaunchSequence(project.bind((blocks, slices), PROJECT_THREADS, [
            *_p(partial, x, fn), ctypes.c_int(tokens), ctypes.c_int(hc * dim), ctypes.c_int(per_slice)],
            shared=shared), finish, *([] if inside else quantise()))
    g = _groups(device, tokens)
    launch = _kernel(device, "hc_pre", dtype, hc).bind(-(-tokens // (g * TOK)), (THREADS // g, g), args)
    if not xn:
        return launch
    return LaunchSequence(launch, ops.rmsnorm(device, dtype, xn, u, norm, tokens, dim, norm_eps), *quantise())


def head(device: Device, dtype, y: int, x: int, fn: int, base: int, scale: int, tokens: int, hc: int, dim: int,
         eps: float, hc_eps: float) -> Launch:
    """y [T, D] = Σ_j (sigmoid(scale·v_j + base_j) + hc_eps) X_j; fn [hc, hc·D], base [hc], scale [1]."""
    if tokens == 0:
        return NOTHING
    k = _kernel(device, "hc_head", dtype, hc)
    g = _groups(device, tokens)
    args = _p(y, x, fn, base, scale) + [ctypes.c_int(tokens), ctypes.c_int(dim), ctypes.c_float(eps),
                                        ctypes.c_float(hc_eps)]
    return k.bind(-(-tokens // (g * TOK)), (THREADS // g, g), args)


def post(device: Device, dtype, out: int, x: int, f: int, post_w: int, comb: int, tokens: int, hc: int,
         dim: int) -> Launch:
    """out [T, hc, D] = post_w[k] · f + Σ_j comb[j, k] · X_j; out may be x (in place), f is [T, D]."""
    if tokens == 0:
        return NOTHING
    k = _kernel(device, "hc_post", dtype, hc)
    args = _p(out, x, f, post_w, comb) + [ctypes.c_int(dim)]
    return k.bind(tokens, _block_1d(-(-dim // _vec(dtype)), THREADS), args)
