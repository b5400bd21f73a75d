"""Sparse attention of docs/model.md#attention and #indexer: window + compressed entries + sink, and the indexer."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .compressor import Compressor, CompressorState
from .ops import Linear, Rope, rmsnorm

QUERY_BLOCK = 256  # queries per score matrix: bounds memory on long prompts


@dataclass
class AttentionState:
    window: np.ndarray                        # last window-1 kv rows, oldest first
    main: CompressorState | None = None
    index: CompressorState | None = None


@dataclass
class Indexer:
    wq_b: Linear              # [nI·dI, q_lora]
    weights_proj: np.ndarray  # [nI, D]
    compressor: Compressor
    topk: int
    round_q: object = None    # Hadamard + fp4 in faithful mode

    def select(self, st: CompressorState, x, qr, pos, rope: Rope, ratio: int) -> np.ndarray:
        """Boolean [T, N]: the top-min(k, visible) visible entries per query, lower index first on ties."""
        n_heads = self.weights_proj.shape[0]
        keys = st.entries
        q = rope(self.wq_b(qr).reshape(len(pos), n_heads, -1), pos)
        if self.round_q is not None:
            q = self.round_q(q)
        d = q.shape[-1]
        w = (x @ self.weights_proj.T) * np.float32(d ** -0.5 * n_heads ** -0.5)
        score = np.einsum("th,thn->tn", w, np.maximum(q @ keys.T, 0))
        visible = np.arange(len(keys))[None, :] < ((pos + 1) // ratio)[:, None]
        score = np.where(visible, score, -np.inf)
        k = min(self.topk, len(keys))
        order = np.argsort(-score, axis=1, kind="stable")[:, :k]
        chosen = np.zeros_like(visible)
        np.put_along_axis(chosen, order, True, axis=1)
        return chosen & visible


@dataclass
class Attention:
    wq_a: Linear
    q_norm: np.ndarray
    wq_b: Linear
    wkv: Linear
    kv_norm: np.ndarray
    wo_a: np.ndarray          # [G·o_lora, (H/G)·hd]
    wo_b: Linear
    sink: np.ndarray          # [H]
    n_heads: int
    n_groups: int
    window: int
    ratio: int
    eps: float
    rope: Rope
    compressor: Compressor | None = None
    indexer: Indexer | None = None
    round_kv: object = None   # fp8 rounding of cached kv in faithful mode
    round_o: object = None    # act_quant of wo_a's input, per group row, in fast mode

    def new_state(self) -> AttentionState:
        hd = self.kv_norm.shape[0]
        return AttentionState(
            window=np.zeros((0, hd), self.kv_norm.dtype),
            main=self.compressor.new_state() if self.compressor else None,
            index=self.indexer.compressor.new_state() if self.indexer else None)

    def __call__(self, st: AttentionState, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        return self.wo_b(self.grouped_output(st, x, pos))

    def grouped_output(self, st: AttentionState, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Everything before wo_b: the groups' wo_a outputs [T, G·o_lora] (a rank's heads and groups when sharded)."""
        T, hd = len(x), self.kv_norm.shape[0]
        qr = rmsnorm(self.wq_a(x), self.q_norm, self.eps)
        q = self.wq_b(qr).reshape(T, self.n_heads, hd)
        q = self.rope(rmsnorm(q, None, self.eps), pos)
        kv = self.rope(rmsnorm(self.wkv(x), self.kv_norm, self.eps), pos)
        if self.round_kv is not None:
            kv = self.round_kv(kv)
        past = len(st.window)
        keys = np.concatenate([st.window, kv])
        st.window = keys[max(0, len(keys) - (self.window - 1)):]

        chosen = None
        if self.compressor is not None:
            self.compressor.update(st.main, x, pos)
            if self.indexer is not None:
                self.indexer.compressor.update(st.index, x, pos)
                chosen = self.indexer.select(st.index, x, qr, pos, self.rope, self.ratio)
        entries = st.main.entries if st.main is not None else np.zeros((0, hd), kv.dtype)

        out = np.empty((T, self.n_heads, hd), q.dtype)
        for a in range(0, T, QUERY_BLOCK):
            b = min(T, a + QUERY_BLOCK)
            lo = max(0, past + a - (self.window - 1))  # first window key any query of the block sees
            kpos = pos[0] - past + np.arange(lo, past + b)
            mask_w = (kpos[None, :] <= pos[a:b, None]) & (kpos[None, :] > pos[a:b, None] - self.window)
            mask_c = np.arange(len(entries))[None, :] < ((pos[a:b] + 1) // max(self.ratio, 1))[:, None]
            if chosen is not None:
                mask_c &= chosen[a:b]
            out[a:b] = self._attend(q[a:b], np.concatenate([keys[lo:past + b], entries]),
                                    np.concatenate([mask_w, mask_c], axis=1))

        o = self.rope(out, pos, inverse=True).reshape(T, self.n_groups, -1)
        if self.round_o is not None:
            o = self.round_o(o)
        wo_a = self.wo_a.reshape(self.n_groups, -1, o.shape[-1])
        return np.matmul(o.transpose(1, 0, 2), wo_a.transpose(0, 2, 1)).transpose(1, 0, 2).reshape(T, -1)

    def _attend(self, q: np.ndarray, keys: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """One softmax over the masked keys plus the per-head sink; K = V."""
        s = (q @ keys.T) * np.float32(q.shape[-1] ** -0.5)
        s = np.where(mask[:, None, :], s, -np.inf)
        m = np.maximum(s.max(axis=-1), self.sink[None, :])
        p = np.exp(s - m[..., None])
        denom = p.sum(axis=-1) + np.exp(self.sink[None, :] - m)
        return (p @ keys) / denom[..., None]
