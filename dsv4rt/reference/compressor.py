"""The KV compressor of docs/model.md#compressor, with its streaming state."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .ops import Rope, rmsnorm, softmax


@dataclass
class CompressorState:
    """What a sequence carries between calls: the unfinished window's (a, z) rows, the previous
    window's first-half rows (overlapping form only) and the entries made so far."""
    width: int
    buf_a: np.ndarray = None
    buf_z: np.ndarray = None
    prev_a: np.ndarray | None = None
    prev_z: np.ndarray | None = None
    entries: np.ndarray = None

    def __post_init__(self):
        self.entries = np.zeros((0, self.width), np.float32)

    @property
    def count(self) -> int:
        return len(self.entries)


@dataclass
class Compressor:
    wkv: np.ndarray          # [c·d, D]
    wgate: np.ndarray        # [c·d, D]
    ape: np.ndarray          # [r, c·d]
    norm: np.ndarray         # [d]
    ratio: int
    eps: float
    rope: Rope
    finish: object = field(default=None)  # rounding applied to finished entries (faithful mode)

    @property
    def width(self) -> int:
        return self.norm.shape[0]

    @property
    def overlap(self) -> bool:
        return self.wkv.shape[0] == 2 * self.width

    def new_state(self) -> CompressorState:
        s = CompressorState(self.width)
        s.buf_a = s.buf_z = np.zeros((0, self.wkv.shape[0]), self.wkv.dtype)
        s.entries = np.zeros((0, self.width), self.wkv.dtype)
        return s

    def update(self, st: CompressorState, x: np.ndarray, pos: np.ndarray) -> int:
        """Feed the chunk x [T, D] at absolute positions pos; append finished entries. Returns how many."""
        r, d = self.ratio, self.width
        a = np.concatenate([st.buf_a, x @ self.wkv.T])
        z = np.concatenate([st.buf_z, x @ self.wgate.T + self.ape[pos % r]])
        n = len(a) // r
        st.buf_a, st.buf_z = a[n * r:], z[n * r:]
        if n == 0:
            return 0
        a, z = a[:n * r].reshape(n, r, -1), z[:n * r].reshape(n, r, -1)
        if self.overlap:
            if st.prev_a is None:
                pa, pz = np.zeros((1, r, d), a.dtype), np.full((1, r, d), -np.inf, z.dtype)
            else:
                pa, pz = st.prev_a[None], st.prev_z[None]
            st.prev_a, st.prev_z = a[-1, :, :d].copy(), z[-1, :, :d].copy()
            a = np.concatenate([np.concatenate([pa, a[:-1, :, :d]]), a[:, :, d:]], axis=1)
            z = np.concatenate([np.concatenate([pz, z[:-1, :, :d]]), z[:, :, d:]], axis=1)
        e = np.sum(softmax(z, axis=1) * a, axis=1)
        e = rmsnorm(e, self.norm, self.eps)
        e = self.rope(e, (st.count + np.arange(n)) * r)
        if self.finish is not None:
            e = self.finish(e)
        st.entries = np.concatenate([st.entries, e.astype(st.entries.dtype)])
        return n
