"""Bytes a decode step must read from HBM: the weights it touches and the cache entries it attends to;
and the FLOPs of a prefill.

Routed experts count as the expected number of distinct experts that B tokens pick (uniform routing):
E·(1 − (1 − k/E)^B) per layer; the embedding counts B rows; every other weight is read once."""
from __future__ import annotations

import numpy as np

from ..config import CSA, HCA, ModelConfig
from ..loader.names import expected_shapes


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


def token_weights(cfg: ModelConfig) -> int:
    """Elements of the weight matrices one token multiplies by, the head aside (the embedding, `ape` and `tid2eid`
    are looked up by row): every matrix of expected_shapes, the routed experts as the n_active of n_experts it picks."""
    dense = routed = 0
    for name, shape in expected_shapes(cfg).items():
        if len(shape) == 2 and not name.endswith(("embed.weight", "head.weight", "ape", "tid2eid")):
            if ".experts." in name:
                routed += shape[0] * shape[1]
            else:
                dense += shape[0] * shape[1]
    return dense + routed * cfg.n_active // cfg.n_experts   # exact: every expert has the same size


def prefill_flops(cfg: ModelConfig, tokens: int, every_logit: bool = False) -> int:
    """FLOPs (2 a multiply-add) of prefilling `tokens` tokens from an empty cache, summed over positions:
    every product with a weight matrix (routed experts: the n_active a token picks), attention (QK and PV
    over the keys each query sees) and the indexer's scores. Norms, RoPE, softmaxes, the compressors'
    pooling and the hyper-connections' stream mixing (O(hc²·D) a token) are left out. The head runs on the
    last position only, as a prefill does, unless `every_logit`."""
    D, H, hd = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    nI, dI = cfg.index_n_heads, cfg.index_head_dim
    pos = np.arange(tokens, dtype=np.int64)
    window = int(np.minimum(pos + 1, cfg.window).sum())
    keys = index_keys = 0
    for kind, r in zip(cfg.kinds, cfg.ratios):
        keys += window
        if r:
            visible = (pos + 1) // r
            keys += int((np.minimum(visible, cfg.index_topk) if kind == CSA else visible).sum())
        if kind == CSA:
            index_keys += int(visible.sum())
    head = cfg.vocab_size * D * (tokens if every_logit else min(tokens, 1))
    return 2 * (token_weights(cfg) * tokens + head + 2 * H * hd * keys + nI * dI * index_keys)
