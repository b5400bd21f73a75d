"""numpy primitives of docs/model.md#primitives (all float32)."""
from __future__ import annotations

import numpy as np


def rmsnorm(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    y = x * (1.0 / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + np.float32(eps)))
    return y if w is None else y * w


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def softmax(x: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


class Rope:
    """Interleaved-pair rotary table for one layer kind; rotates the last 2·len(inv_freq) channels."""

    def __init__(self, inv_freq: np.ndarray):
        self.inv_freq = inv_freq.astype(np.float32)
        self.dim = 2 * len(inv_freq)

    def __call__(self, x: np.ndarray, pos: np.ndarray, inverse: bool = False) -> np.ndarray:
        """x: [T, ..., d]; pos: [T]. Angles in float32 like the Hugging Face implementation."""
        ang = pos.astype(np.float32)[:, None] * self.inv_freq
        cos, sin = np.cos(ang), np.sin(ang)
        if inverse:
            sin = -sin
        shape = (len(pos),) + (1,) * (x.ndim - 2) + (self.dim // 2,)
        cos, sin = cos.reshape(shape), sin.reshape(shape)
        out = x.copy()
        ev, od = x[..., -self.dim::2], x[..., -self.dim + 1::2]
        out[..., -self.dim::2] = ev * cos - od * sin
        out[..., -self.dim + 1::2] = od * cos + ev * sin
        return out


class Linear:
    """y = x·Wᵀ; in faithful mode a weight stored as fp8/fp4 first rounds its input (act_quant)."""

    def __init__(self, w: np.ndarray, quant_input=None):
        self.w = w
        self.quant_input = quant_input

    @property
    def shape(self):
        return self.w.shape

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.quant_input is not None:
            x = self.quant_input(x)
        return x @ self.w.T
