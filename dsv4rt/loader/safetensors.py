"""Safetensors reader: our own header parser, tensors as zero-copy views of a read-only mmap.

As strict as the format (and the safetensors library): the tensors must tile the data section exactly, in
offset order, with no gap between two tensors and nothing after the last. Unindexed bytes are what
makes a file a polyglot or hides a truncated rewrite, and every writer we know (safetensors itself, the
released checkpoints) packs them without gaps, so a file with a gap is refused rather than half-read."""
from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from ..files import is_int, load_json, open_regular


class CheckpointError(ValueError):
    pass


DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E8M0": np.dtype(getattr(ml_dtypes, "float8_e8m0fnu", np.uint8)),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_FIELDS = ("dtype", "shape", "data_offsets")


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offsets relative to the start of the data section
    end: int


def _unique_keys(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise CheckpointError(f"key {k!r} appears twice in the header")
        out[k] = v
    return out


def parse_header(buf, where: str) -> tuple[dict[str, TensorInfo], int]:
    """Validate the header of a safetensors image `buf`; returns the tensors and the data section's offset."""
    size = len(buf)
    if size < 8:
        raise CheckpointError(f"{where}: file is {size} bytes, too short for a safetensors header")
    n = int.from_bytes(buf[:8], "little")
    if n > size - 8:
        raise CheckpointError(f"{where}: header length {n} runs past the end of the {size}-byte file")
    try:
        header = load_json(bytes(buf[8:8 + n]), object_pairs_hook=_unique_keys)
    except CheckpointError as e:
        raise CheckpointError(f"{where}: {e}") from None
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError, JSONDecodeError, json_int's
        raise CheckpointError(f"{where}: header is not valid JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{where}: header is not a JSON object")
    data_size = size - 8 - n
    tensors = {name: _entry(name, e, data_size, where) for name, e in header.items() if name != "__metadata__"}
    at, previous = 0, None
    for begin, end, name in sorted((t.begin, t.end, name) for name, t in tensors.items()):
        if begin < at:
            raise CheckpointError(f"{where}: tensors {previous!r} and {name!r} overlap")
        if begin > at:
            raise CheckpointError(f"{where}: data bytes {at}..{begin} before tensor {name!r} belong to no tensor "
                                  "(safetensors packs tensors without gaps)")
        at, previous = end, name
    if at != data_size:
        raise CheckpointError(f"{where}: the last {data_size - at} bytes of the data section belong to no tensor "
                              "(safetensors packs tensors without gaps)")
    return tensors, 8 + n


def _entry(name: str, e, data_size: int, where: str) -> TensorInfo:
    def bad(why):
        return CheckpointError(f"{where}: tensor {name!r} {why}")
    if not isinstance(e, dict):
        raise bad("has an entry that is not a JSON object")
    for f in _FIELDS:
        if f not in e:
            raise bad(f"is missing '{f}'")
    dtype, shape, offs = (e[f] for f in _FIELDS)
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise bad(f"has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
        raise bad(f"has invalid shape {shape!r} (need a list of non-negative integers)")
    if not isinstance(offs, list) or len(offs) != 2 or not all(is_int(o) for o in offs):
        raise bad(f"has invalid data_offsets {offs!r} (need [begin, end])")
    begin, end = offs
    if end < begin:
        raise bad(f"has data_offsets {offs} whose end comes before its begin")
    if begin < 0 or end > data_size:
        raise bad(f"has data_offsets {offs} outside the {data_size}-byte data section")
    need = math.prod(shape) * DTYPES[dtype].itemsize
    if end - begin != need:
        raise bad(f"holds {end - begin} bytes but {dtype} {shape} needs {need}")
    return TensorInfo(dtype, tuple(shape), begin, end)


class SafetensorsFile:
    """One .safetensors file, mapped read-only; `array()` returns views into the mapping."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._mm = b""
        self._fd = open_regular(self.path, CheckpointError)
        try:
            self._stat = os.fstat(self._fd)
            # mmap refuses empty files; the parser reports them instead
            if self._stat.st_size:
                self._mm = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)
            self.tensors, self._data = parse_header(self._mm, str(self.path))
        except OSError as e:
            self.close()
            raise CheckpointError(f"{self.path}: cannot map ({e.strerror})") from None
        except CheckpointError:
            self.close()
            raise

    def check_unchanged(self) -> None:
        """A file cut short under the mapping kills the process (SIGBUS) at the first read past its new end,
        and one rewritten in place hands out other weights: both are refused before a tensor is handed out.
        (A rename over the file is harmless: the mapping keeps the old one.)"""
        now = os.fstat(self._fd)
        if (now.st_size, now.st_mtime_ns) != (self._stat.st_size, self._stat.st_mtime_ns):
            raise CheckpointError(f"{self.path}: changed while open ({self._stat.st_size} bytes when opened, now "
                                  f"{now.st_size}); reopen the checkpoint")

    def array(self, name: str) -> np.ndarray:
        self.check_unchanged()
        t = self.tensors[name]
        dt = DTYPES[t.dtype]
        return np.frombuffer(self._mm, dt, (t.end - t.begin) // dt.itemsize, self._data + t.begin).reshape(t.shape)

    def close(self):
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if isinstance(self._mm, mmap.mmap):
            try:
                self._mm.close()
            except BufferError:
                pass  # arrays still view the mapping; it is unmapped when the last one is freed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
