"""What a GpuModel holds in the arena, from its config and shapes alone (no GPU): the weights as its build stores
them, the step workspace by name, the page tables, and the row chunks in which the indexer scores a step. GpuModel
allocates these sizes and `dsv4rt plan --step` prints them (docs/caches.md#a-1m-token-prompt)."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from ..config import CSA, ModelConfig
from ..cuda.arena import ALIGN
from ..cuda.build import WGMMA_ARCH
from ..kv.plan import build_plan, main_entry_bytes
from ..loader import expected_shapes, fp4_scale_shape, fp8_scale_shape
from ..loader.names import released_format
from . import attention as attn_k
from . import fp8, moe, moe_fp4
from . import hc as hc_k
from .compress import MAX_GRID_Y
from .gemm import WORKSPACE_BYTES
from .gemm_w8a16 import w8a16_fits
from .inputs import StepInputs
from .linear_fp8 import SKINNY_ROWS
from .tables import slot_columns
from .weights import stays_float32

STEP_TOKENS = 8192     # default rows of a step: big enough that prefill GEMMs run at tensor-core speed
LOGIT_ROWS = 1024      # rows of logits a step may return beyond one per request (forward's every_row)
# The indexer's float32 scores of a step, [rows, n_max], stay within this: a step of 8192 rows at 1M positions
# would take 8.6 GB, so beyond it the step's rows are scored and selected in chunks through one buffer. At 1M
# positions 1 GiB still holds 1,023 rows, several score blocks for every SM.
SCORES_BUDGET = 1 << 30
H200_SMS = 132         # the SMs `dsv4rt plan` sizes the attention and mHC workspaces for
BUILD_BLAS = 3         # cuBLAS handles of a GpuModel: the main stream's and the compressor's and indexer's


def aligned(nbytes: int) -> int:
    """What an arena allocation or a workspace array of nbytes occupies."""
    return max(ALIGN, -(-nbytes // ALIGN) * ALIGN)


def step_shape(max_len: int, rows: int | None = None, max_batch: int = 1) -> tuple[int, int]:
    """A GpuModel's rows a step (step_rows, by default STEP_TOKENS and at most max_len) and rows of logits a step."""
    rows = rows or min(STEP_TOKENS, max_len)
    return rows, min(rows, max(max_batch, LOGIT_ROWS))


def index_entries(cfg: ModelConfig, max_len: int) -> int:
    """Columns of the indexer's scores: one more than the compressed entries a position below max_len sees at most."""
    return max_len // cfg.csa_ratio + 1


def score_rows(rows: int, n_max: int, budget: int = SCORES_BUDGET) -> int:
    """Rows the indexer scores and selects per launch pair: all of a step's while their scores fit the budget,
    else as many as do, at least one. The kernels take any count (a grid row per query row, each row's pointers
    aligned at any row offset) up to MAX_GRID_Y."""
    return max(1, min(rows, MAX_GRID_Y, budget // (4 * n_max)))


def moe_dims(cfg: ModelConfig, rows: int) -> moe.MoeDims:
    return moe.MoeDims(rows, cfg.hidden_size, cfg.moe_inter, cfg.n_experts, cfg.n_active,
                       cfg.moe_inter if cfg.n_shared else 0)


def tensor_core_attention(cfg: ModelConfig, dtype) -> bool:
    """Whether the build attends on the tensor cores (sparse_attention_mqa): bf16 builds do, float32 ones on the
    CUDA cores."""
    return np.dtype(dtype).itemsize == 2 and cfg.head_dim % 16 == 0


def attention_splits(cfg: ModelConfig, dtype, layer: int, rows: int, max_len: int, sm_count: int) -> int:
    c = cfg
    ratio = c.ratios[layer]
    compressed = c.index_topk if c.kinds[layer] == CSA else max_len // ratio if ratio else 0
    if tensor_core_attention(cfg, dtype):
        return attn_k.attention_mqa_splits(rows, c.num_heads, c.window + compressed, sm_count)
    return attn_k.attention_splits(rows, c.num_heads, c.window + compressed, dtype, sm_count)


def workspace_sizes(cfg: ModelConfig, dtype, *, rows: int, out_rows: int, max_len: int, sm_count: int,
                    numerics: str = "exact", fp8_attention: bool = False, fp4_experts: bool = False,
                    fp8_wo_a: bool = False, scores_budget: int = SCORES_BUDGET,
                    arch: str = WGMMA_ARCH) -> dict[str, int]:
    """A GpuModel's step workspace by name: `rows` tokens a step, logits of `out_rows` of them, requests of up to
    max_len positions; the formats as GpuModel finds them in the checkpoint, on a device of this arch."""
    c, T, s = cfg, rows, np.dtype(dtype).itemsize
    hd, D = c.head_dim, c.hidden_size
    n_max = index_entries(cfg, max_len)
    moe_bytes = (moe_fp4.workspace_bytes if fp4_experts else moe.workspace_bytes)(moe_dims(cfg, T), dtype)
    # act_quant's e4m3 copies and e8m0 scales of the fp8 GEMMs' inputs (the indexer's own, on its stream)
    widths = dict(xn=D, qr=c.q_lora_rank, iqr=c.q_lora_rank, t=c.o_groups * c.o_lora_rank) if fp8_attention else {}
    quantized = {f"{x}_{part}": T * (k if part == "q" else fp8.scale_columns(k))
                 for x, k in widths.items() for part in ("q", "s")}
    expanded, group_k = {}, c.num_heads * hd // c.o_groups
    if fp8_wo_a and numerics == "fast":   # o quantised per group row (GpuModel._output_projection)
        quantized.update(o_q=T * c.num_heads * hd, o_s=T * c.o_groups * fp8.scale_columns(group_k))
    elif fp8_wo_a and T > SKINNY_ROWS and not w8a16_fits(arch, dtype, c.o_lora_rank, group_k):
        expanded = dict(wo_a=c.o_lora_rank * c.num_heads * hd * s)   # fp8.dequantize's weight for cuBLAS
    fused = min(T, hc_k.decode_tokens(sm_count))  # rows of the second streams, post and comb (GpuModel._hc_pre)
    layers = {(k, r): i for i, (k, r) in enumerate(zip(c.kinds, c.ratios))}.values()   # one of each kind
    return dict(
        inputs=StepInputs(T).nbytes, X=T * c.hc_mult * D * s, u=T * D * s, xn=T * D * s,
        post=T * c.hc_mult * 4, comb=T * c.hc_mult ** 2 * 4, X_b=fused * c.hc_mult * D * s,
        post_b=fused * c.hc_mult * 4, comb_b=fused * c.hc_mult ** 2 * 4, qa=T * c.q_lora_rank * s,
        qr=T * c.q_lora_rank * s, q=T * c.num_heads * hd * s, kv=T * hd * s, a=T * 2 * hd * 4, z=T * 2 * hd * 4,
        ia=T * 2 * c.index_head_dim * 4, iz=T * 2 * c.index_head_dim * 4,
        iq=T * c.index_n_heads * c.index_head_dim * s, iw=T * c.index_n_heads * 4,
        scores=score_rows(T, n_max, scores_budget) * n_max * 4,
        selected=T * c.index_topk * 4, o=T * c.num_heads * hd * s, t=T * c.o_groups * c.o_lora_rank * s,
        f=T * D * s, y=T * D * s, logits=out_rows * c.vocab_size * 4,
        kv_rows=T * main_entry_bytes(cfg, numerics, s), moe=moe_bytes, **quantized, **expanded,
        hc_pre=hc_k.pre_workspace_bytes(T, c.hc_mult, D),
        att=max(attn_k.attention_workspace_bytes(t, c.num_heads, hd, attention_splits(cfg, dtype, i, t, max_len,
                                                                                      sm_count))
                for t in range(1, min(T, 2 * sm_count) + 1) for i in layers))   # splits = 1 beyond 2·sm_count rows


def weight_bytes(cfg: ModelConfig, dtype, released: bool = False) -> int:
    """The arena bytes of load_weights: every tensor in the build's type (float32 where it stays float32, hash
    tables int32), or with `released` the fp8 and fp4 weights as released, each with its e8m0 scales."""
    s, total = np.dtype(dtype).itemsize, 0
    for name, shape in expected_shapes(cfg).items():
        fmt, count = released_format(name), math.prod(shape)
        if released and fmt in ("fp8", "fp4"):
            scales = fp8_scale_shape(shape) if fmt == "fp8" else fp4_scale_shape(shape)
            parts = (count if fmt == "fp8" else count // 2, math.prod(scales))
        else:
            parts = (count * (4 if name.endswith("tid2eid") or stays_float32(name) else s),)
        total += sum(-(-p // ALIGN) * ALIGN for p in parts)
    return aligned(total)


def memory_plan(cfg: ModelConfig, numerics: str, *, max_len: int, rows: int | None = None, max_batch: int = 1,
                dtype=ml_dtypes.bfloat16, sm_count: int = H200_SMS, arch: str = WGMMA_ARCH,
                scores_budget: int = SCORES_BUDGET) -> dict:
    """What GpuModel(dir, dtype, max_len=max_len, max_batch=max_batch, step_rows=rows) allocates in the arena besides
    its KV cache (kv_bytes, the caller's), by name, on a device of sm_count SMs and this arch (an H200 by default).
    The checkpoint is taken to be in the released formats (fp8 attention and wo_a, fp4 experts) where cfg has a
    quantisation config and numerics are not exact."""
    released = numerics != "exact" and bool(cfg.quant)
    rows, out_rows = step_shape(max_len, rows, max_batch)
    workspace = {name: aligned(size) for name, size in workspace_sizes(
        cfg, dtype, rows=rows, out_rows=out_rows, max_len=max_len, sm_count=sm_count, numerics=numerics,
        fp8_attention=released, fp4_experts=released, fp8_wo_a=released, scores_budget=scores_budget,
        arch=arch).items()}
    tables = (2 if released else 1) * 3      # weight (and scale) pointers of w1, w3, w2
    plan = build_plan(cfg, numerics, element_bytes=np.dtype(dtype).itemsize)
    other = {"page tables": aligned(8 * max_batch * slot_columns(plan, max_len)), "page starts": aligned(4 * max_batch),
             "rope tables": sum(aligned(4 * cfg.rope_inv_freq(i).size) for i in range(cfg.num_layers)),
             "expert pointer tables": cfg.num_layers * tables * aligned(8 * cfg.n_experts),
             "cuBLAS workspaces": BUILD_BLAS * aligned(WORKSPACE_BYTES)}
    n_max = index_entries(cfg, max_len)
    weights = weight_bytes(cfg, dtype, released)
    return dict(numerics=numerics, dtype=np.dtype(dtype).name, max_len=max_len, rows=rows, out_rows=out_rows,
                max_batch=max_batch, sm_count=sm_count, n_max=n_max, score_rows=score_rows(rows, n_max, scores_budget),
                weights=weights, workspace=workspace, other=other,
                total=weights + sum(workspace.values()) + sum(other.values()))
