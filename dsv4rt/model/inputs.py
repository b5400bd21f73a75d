"""A step's inputs, packed into one host buffer that goes to the device in one copy: the rows' token
ids, positions and request slots, the rows whose logits are wanted, and per-row sampling settings.
Device pointers stay fixed, so captured decode graphs read each replay's inputs from the same place."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# (name, dtype); 8-byte fields first so every field stays aligned for any row count
FIELDS = (("seed", np.uint64), ("step", np.uint64), ("ids", np.int32), ("pos", np.int32), ("req", np.int32),
          ("out_rows", np.int32), ("top_k", np.int32), ("tokens", np.int32), ("temperature", np.float32),
          ("top_p", np.float32))


@dataclass
class SamplingArrays:
    """Per-request sampling settings of a step, in entry order (see dsv4rt/model/sample.py)."""
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    seed: np.ndarray
    step: np.ndarray


@dataclass
class DecodeRows:
    """A step of one token per request as arrays, in place of a list of Entry: request slots, token ids
    and positions. The serving engine's decode steps build no object per request."""
    slot: np.ndarray
    ids: np.ndarray
    pos: np.ndarray

    def __len__(self) -> int:
        return len(self.slot)


# the settings of output rows without a request's (padding, logits only)
NO_SAMPLING = dict(temperature=0.0, top_k=0, top_p=1.0, seed=0, step=0)


class StepInputs:
    def __init__(self, rows: int):
        self.rows = rows
        self.offsets, at = {}, 0
        for name, dtype in FIELDS:
            self.offsets[name] = at
            at += rows * np.dtype(dtype).itemsize
        self.nbytes = at
        self.host = np.zeros(at, np.uint8)
        self.view = {name: self.host[self.offsets[name]:self.offsets[name] + rows * np.dtype(dt).itemsize].view(dt)
                     for name, dt in FIELDS}
        self.row_index = np.arange(rows, dtype=np.int32)
        self.n_out = 0

    def pointers(self, base: int) -> dict[str, int]:
        return {name: base + off for name, off in self.offsets.items()}

    def fill(self, entries, pad_to: int = 0, every_row: bool = True, sampling: SamplingArrays | None = None) -> int:
        """Write the step's rows (a list of Entry, or DecodeRows); returns their count (padding included).
        With pad_to (decode graphs) every entry has one token and all pad_to rows are output rows."""
        v, n = self.view, len(entries)
        decode = entries if isinstance(entries, DecodeRows) else None
        lengths = None if decode else [len(e.ids) for e in entries]
        T = n if decode else sum(lengths)
        if pad_to:
            if T != n or n > pad_to:
                raise ValueError(f"a padded step takes one token per request, at most {pad_to} requests")
            T = pad_to
        if T > self.rows:
            raise ValueError(f"a step of {T} tokens exceeds the workspace's {self.rows} rows")
        if T == n or pad_to:          # one token each (decode): no per-entry slicing, it is host time per step
            if decode is None:
                decode = DecodeRows([e.slot for e in entries], [int(e.ids[0]) for e in entries],
                                    [e.start for e in entries])
            v["ids"][:n], v["pos"][:n], v["req"][:n] = decode.ids, decode.pos, decode.slot
            if T > n:
                v["ids"][n:T], v["pos"][n:T], v["req"][n:T] = 0, 0, -1
        else:
            at = 0
            for e, k in zip(entries, lengths):
                v["ids"][at:at + k] = e.ids
                v["pos"][at:at + k] = np.arange(e.start, e.start + k)
                v["req"][at:at + k] = e.slot
                at += k
        if pad_to or every_row:
            self.n_out = T
            v["out_rows"][:T] = self.row_index[:T]
        else:
            self.n_out = n
            v["out_rows"][:n] = np.cumsum(lengths) - 1 if lengths else self.row_index[:n]
        given = n if sampling is not None else 0
        for name, default in NO_SAMPLING.items():
            if given:
                v[name][:n] = getattr(sampling, name)
            if self.n_out > given:
                v[name][given:self.n_out] = default
        return T
