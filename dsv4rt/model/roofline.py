"""Bytes a decode step must read from HBM: the weights it touches and the cache entries it attends to.

Routed experts count as the expected number of distinct experts that B tokens pick (uniform routing):
E·(1 − (1 − k/E)^B) per layer; the embedding counts B rows; every other weight is read once."""
from __future__ import annotations

from ..config import CSA, HCA, ModelConfig


def weight_bytes(cfg: ModelConfig, sizes: dict[str, int], batch: int) -> float:
    """sizes: bytes of each weight tensor by name (GpuModel.w)."""
    E, k = cfg.n_experts, cfg.n_active
    touched = E * (1 - (1 - k / E) ** batch) if E else 0
    total = 0.0
    for name, nbytes in sizes.items():
        if ".experts." in name:
            total += nbytes * touched / E
        elif name.startswith("embed"):
            total += nbytes * min(batch, cfg.vocab_size) / cfg.vocab_size
        else:
            total += nbytes
    return total


def cache_bytes(cfg: ModelConfig, context: int, element_bytes: int) -> float:
    """One request's cache reads at position `context`: window keys, the compressed entries attention
    reads (top-k of c4a, all of c128a), all indexer keys."""
    hd, total = cfg.head_dim, 0
    for kind, ratio in zip(cfg.kinds, cfg.ratios):
        total += min(context, cfg.window) * hd
        if kind == CSA:
            total += min(context // ratio, cfg.index_topk) * hd + context // ratio * cfg.index_head_dim
        elif kind == HCA:
            total += context // ratio * hd
    return total * element_bytes


def decode_bytes(cfg: ModelConfig, sizes: dict[str, int], batch: int, context: int, element_bytes: int) -> float:
    return weight_bytes(cfg, sizes, batch) + batch * cache_bytes(cfg, context, element_bytes)
