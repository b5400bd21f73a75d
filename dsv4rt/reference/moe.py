"""Mixture of experts of MODEL.md section 8: sqrtsoftplus gate, bias or hash routing, clamped SwiGLU."""
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

    def __call__(self, x: np.ndarray) -> np.ndarray:
        gate = np.minimum(self.w1(x), self.limit)
        up = np.clip(self.w3(x), -self.limit, self.limit)
        return self.w2(silu(gate) * up)


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
        y = self.shared(x) if self.shared is not None else np.zeros_like(x)
        for e in np.unique(idx):
            tok, slot = np.nonzero(idx == e)
            np.add.at(y, tok, self.experts[e](x[tok]) * w[tok, slot, None])
        return y
