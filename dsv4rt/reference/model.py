"""The whole DeepSeek V4 forward in numpy float32, with explicit per-request state."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import numpy as np

from ..config import CSA, SLIDING, ModelConfig
from .attention import Attention, AttentionState, Indexer
from .compressor import Compressor
from .hc import HyperConnection, HyperHead
from .moe import MoE, Expert
from .ops import Linear, Rope, rmsnorm
from . import quant


def check_ids(ids: np.ndarray, vocab: int, error=ValueError) -> None:
    """`error(message)` unless every id of the non-empty `ids` is in [0, vocab)."""
    if ids.min() < 0 or ids.max() >= vocab:
        raise error(f"token ids must lie in [0, {vocab}), got {ids.min()}..{ids.max()}")


def check_chunks(chunks: list[int], n: int, error=ValueError) -> None:
    """`error(message)` unless the chunk sizes are positive and sum to the `n` tokens."""
    if sum(chunks) != n or any(c <= 0 for c in chunks):
        raise error(f"chunk sizes {chunks} must be positive and sum to the {n} tokens")


@dataclass(frozen=True)
class Numerics:
    """Which of the official reference's roundings are on (docs/numerics.md)."""
    act_quant: bool = False     # e4m3 inputs of GEMMs whose weight is stored in fp8/fp4
    kv_fp8: bool = False        # cached kv nope dims on e4m3
    indexer_fp4: bool = False   # Hadamard + e2m1 on indexer queries and keys
    wo_a_quant: bool = False    # e4m3 input of wo_a when stored in fp8: the fast numerics' one extra rounding

    @staticmethod
    def named(name: str) -> "Numerics":
        if name == "exact":
            return Numerics()
        if name == "faithful":
            return Numerics(True, True, True)
        if name == "fast":
            return Numerics(True, True, True, True)
        raise ValueError(f"unknown numerics '{name}' (expected exact, faithful or fast)")


@dataclass
class SequenceState:
    """Everything a request carries between calls: its length and each layer's caches."""
    pos: int
    layers: list[AttentionState] = field(default_factory=list)


@dataclass
class Layer:
    attn_hc: HyperConnection
    ffn_hc: HyperConnection
    attn_norm: np.ndarray
    ffn_norm: np.ndarray
    attn: Attention
    moe: MoE

    def __call__(self, X, st: AttentionState, ids, pos, eps):
        u, post, comb = self.attn_hc.pre(X)
        X = HyperConnection.post(X, self.attn(st, rmsnorm(u, self.attn_norm, eps), pos), post, comb)
        u, post, comb = self.ffn_hc.pre(X)
        return HyperConnection.post(X, self.moe(rmsnorm(u, self.ffn_norm, eps), ids), post, comb)


class Model:
    def __init__(self, cfg: ModelConfig, weights, numerics: Numerics = Numerics(), quantized=frozenset()):
        """weights: official name -> float32 array (dequantised); quantized: names stored as fp8/fp4."""
        self.cfg, self.numerics, self.quantized = cfg, numerics, quantized
        W = weights

        def lin(name):
            aq = quant.act_quant if numerics.act_quant and name in quantized else None
            return Linear(W[name], aq)

        self.embed, self.head, self.norm = W["embed.weight"], W["head.weight"], W["norm.weight"]
        self.hc_head = HyperHead(W["hc_head_fn"], W["hc_head_base"], W["hc_head_scale"], cfg.hc_eps, cfg.eps)
        self.layers = [self._layer(cfg, W, lin, i) for i in range(cfg.num_layers)]

    def _layer(self, cfg, W, lin, i) -> Layer:
        p = f"layers.{i}."
        kind, ratio = cfg.kinds[i], cfg.ratios[i]
        rope = Rope(cfg.rope_inv_freq(i))

        def hc(n):
            return HyperConnection(W[p + f"hc_{n}_fn"], W[p + f"hc_{n}_base"], W[p + f"hc_{n}_scale"],
                                   cfg.hc_iters, cfg.hc_eps, cfg.eps)

        def comp(q, finish):
            return Compressor(W[q + "wkv.weight"], W[q + "wgate.weight"], W[q + "ape"], W[q + "norm.weight"],
                              ratio, cfg.eps, rope, finish)

        n = self.numerics
        kv_round = partial(quant.kv_round, rope_dim=cfg.rope_dim) if n.kv_fp8 else None
        idx_round = quant.indexer_round if n.indexer_fp4 else None
        a = p + "attn."
        o_round = quant.act_quant if n.wo_a_quant and a + "wo_a.weight" in self.quantized else None
        indexer = None
        if kind == CSA:
            indexer = Indexer(lin(a + "indexer.wq_b.weight"), W[a + "indexer.weights_proj.weight"],
                              comp(a + "indexer.compressor.", idx_round), cfg.index_topk, idx_round)
        attn = Attention(
            lin(a + "wq_a.weight"), W[a + "q_norm.weight"], lin(a + "wq_b.weight"), lin(a + "wkv.weight"),
            W[a + "kv_norm.weight"], W[a + "wo_a.weight"], lin(a + "wo_b.weight"), W[a + "attn_sink"],
            cfg.num_heads, cfg.o_groups, cfg.window, ratio, cfg.eps, rope,
            comp(a + "compressor.", kv_round) if kind != SLIDING else None, indexer, kv_round, o_round)

        def expert(q):
            return Expert(lin(q + "w1.weight"), lin(q + "w2.weight"), lin(q + "w3.weight"), cfg.swiglu_limit)

        f = p + "ffn."
        hashed = cfg.hash_layers[i]
        moe = MoE(W[f + "gate.weight"], None if hashed else W[f + "gate.bias"],
                  W[f + "gate.tid2eid"] if hashed else None,
                  [expert(f + f"experts.{e}.") for e in range(cfg.n_experts)],
                  expert(f + "shared_experts.") if cfg.n_shared else None, cfg.n_active, cfg.routed_scaling)
        return Layer(hc("attn"), hc("ffn"), W[p + "attn_norm.weight"], W[p + "ffn_norm.weight"], attn, moe)

    def new_state(self) -> SequenceState:
        return SequenceState(0, [layer.attn.new_state() for layer in self.layers])

    def embed_streams(self, ids: np.ndarray) -> np.ndarray:
        x = self.embed[ids]
        return np.repeat(x[:, None, :], self.cfg.hc_mult, axis=1)

    def layer(self, i: int, X: np.ndarray, st: SequenceState, ids: np.ndarray) -> np.ndarray:
        """One block on streams X [T, hc, D] at the state's current position (does not advance it)."""
        pos = st.pos + np.arange(len(ids))
        return self.layers[i](X, st.layers[i], ids, pos, self.cfg.eps)

    def final_hidden(self, X: np.ndarray) -> np.ndarray:
        return rmsnorm(self.hc_head(X), self.norm, self.cfg.eps)

    def forward(self, st: SequenceState, ids, streams: list | None = None) -> np.ndarray:
        """Logits [T, vocab] of the chunk `ids`, continuing `st` (which advances by T).
        `streams`, when given, receives the residual streams entering each layer, then the last layer's output."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if len(ids) == 0:
            return np.zeros((0, self.cfg.vocab_size), np.float32)
        check_ids(ids, self.cfg.vocab_size)
        X = self.embed_streams(ids)
        for i in range(len(self.layers)):
            if streams is not None:
                streams.append(X)
            X = self.layer(i, X, st, ids)
        if streams is not None:
            streams.append(X)
        st.pos += len(ids)
        return self.final_hidden(X) @ self.head.T

    def logits_chunked(self, ids: np.ndarray, chunks=None) -> np.ndarray:
        """Logits of every position, the prompt fed in the given chunk sizes with the state carried."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        chunks = [len(ids)] if chunks is None else [int(c) for c in chunks]
        check_chunks(chunks, len(ids))
        st, out, at = self.new_state(), [], 0
        for c in chunks:
            out.append(self.forward(st, ids[at:at + c]))
            at += c
        return np.concatenate(out)
