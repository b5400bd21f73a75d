"""Memory of a group of GPUs under the layout of docs/parallel.md: weights per rank and the KV cache left over."""
from __future__ import annotations

from ..config import ModelConfig
from ..kv.plan import build_plan
from .layout import Layout

GIB = 1 << 30
GPU_MEMORY = 140 * GIB       # an H200 as the issue budgets it
# Set aside on every GPU for a step's activations, the cuBLAS workspaces, decode graphs and NCCL's buffers.
WORKSPACE = 4 * GIB


def group_plan(cfg: ModelConfig, gpus: int, gpu_memory: int = GPU_MEMORY, workspace: int = WORKSPACE,
               numerics: str | None = None) -> dict:
    """Weights in the released formats and the cache tokens that fit. Every rank keeps every sequence's cache
    (K = V is a single head, docs/parallel.md#caches), so the group holds what its fullest GPU has room for."""
    per_rank = Layout(cfg, gpus).bytes_per_rank()
    total = per_rank[0] if gpus == 1 else Layout(cfg, 1).bytes_per_rank()[0]
    kv = build_plan(cfg, numerics)
    free = gpu_memory - max(per_rank) - workspace
    return dict(gpus=gpus, gpu_memory_bytes=gpu_memory, workspace_bytes=workspace, weight_bytes_total=total,
                weight_bytes_per_gpu=max(per_rank), weight_bytes_replicated=sum(per_rank) - total,
                kv_numerics=kv.numerics, kv_bytes_per_token=kv.bytes_per_token, fits=free >= 0,
                kv_tokens=kv.tokens_fitting(free))
