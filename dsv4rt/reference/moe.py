"""Mixture of experts of docs/model.md#moe: sqrtsoftplus gate, bias or hash routing, clamped SwiGLU."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .ops import Linear, silu


@dataclass
class Expert:
    w1: Linear
    w2: Linear
    w3: Linear
    limit: float

    def __call__(self, x: np.ndarray, weight: np.ndarray | None = None) -> np.ndarray:
        """weight [rows]: the routing weights, applied to the SwiGLU output before w2 (and before its input
        quantisation), the official order."""
        gate = np.minimum(self.w1(x), self.limit)
        up = np.clip(self.w3(x), -self.limit, self.limit)
        h = silu(gate) * up
        return self.w2(h if weight is None else h * weight[:, None])


@dataclass
class MoE:
    gate: np.ndarray               # [E, D]
    bias: np.ndarray | None        # [E], routed layers
    tid2eid: np.ndarray | None     # [vocab, k], hash layers
    experts: list[Expert]
    shared: Expert | None
    n_active: int
    scaling: float

    def route(self, x: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        s = np.sqrt(np.logaddexp(0, x @ self.gate.T))
        if self.tid2eid is not None:
            idx = self.tid2eid[ids].astype(np.int64)
        else:
            idx = np.argpartition(-(s + self.bias), self.n_active - 1, axis=1)[:, :self.n_active]
        w = np.take_along_axis(s, idx, axis=1)
        return idx, w / (w.sum(axis=1, keepdims=True) + np.float32(1e-20)) * np.float32(self.scaling)

    def __call__(self, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
        idx, w = self.route(x, ids)
        return self.add_routed(self.shared(x) if self.shared is not None else np.zeros_like(x), x, idx, w)

    def add_routed(self, y: np.ndarray, x: np.ndarray, idx: np.ndarray, w: np.ndarray) -> np.ndarray:
        """y += the weighted outputs of the experts each row is routed to; idx indexes self.experts, and -1
        marks a slot whose expert another rank holds (docs/parallel.md)."""
        for e in np.unique(idx[idx >= 0]):
            tok, slot = np.nonzero(idx == e)
            np.add.at(y, tok, self.experts[e](x[tok], w[tok, slot]))
        return y
