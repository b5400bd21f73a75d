"""Manifold-constrained hyper-connections of docs/model.md#hyper-connections."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .ops import rmsnorm, sigmoid, softmax


@dataclass
class HyperConnection:
    fn: np.ndarray      # [(2+hc)·hc, hc·D]
    base: np.ndarray    # [(2+hc)·hc]
    scale: np.ndarray   # [3]
    iters: int
    hc_eps: float
    eps: float

    def pre(self, X: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """X [T, hc, D] -> (block input u [T, D], post [T, hc], comb [T, hc, hc])."""
        T, hc, D = X.shape
        v = rmsnorm(X.reshape(T, hc * D), None, self.eps) @ self.fn.T   # explicit widths: T may be 0 on a rank
        pre = sigmoid(self.scale[0] * v[:, :hc] + self.base[:hc]) + np.float32(self.hc_eps)
        post = 2 * sigmoid(self.scale[1] * v[:, hc:2 * hc] + self.base[hc:2 * hc])
        c = self.scale[2] * v[:, 2 * hc:].reshape(T, hc, hc) + self.base[2 * hc:].reshape(hc, hc)
        c = softmax(c, axis=-1) + np.float32(self.hc_eps)
        c = c / (c.sum(axis=-2, keepdims=True) + np.float32(self.hc_eps))
        for _ in range(self.iters - 1):
            c = c / (c.sum(axis=-1, keepdims=True) + np.float32(self.hc_eps))
            c = c / (c.sum(axis=-2, keepdims=True) + np.float32(self.hc_eps))
        return np.einsum("tj,tjd->td", pre, X), post, c

    @staticmethod
    def post(X: np.ndarray, f: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
        return post[:, :, None] * f[:, None, :] + np.einsum("tjk,tjd->tkd", comb, X)


@dataclass
class HyperHead:
    fn: np.ndarray      # [hc, hc·D]
    base: np.ndarray    # [hc]
    scale: np.ndarray   # [1]
    hc_eps: float
    eps: float

    def __call__(self, X: np.ndarray) -> np.ndarray:
        v = rmsnorm(X.reshape(len(X), self.fn.shape[1]), None, self.eps) @ self.fn.T
        pre = sigmoid(self.scale[0] * v + self.base) + np.float32(self.hc_eps)
        return np.einsum("tj,tjd->td", pre, X)
