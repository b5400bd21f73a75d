"""A checkpoint's tensors in the storage type of a GPU build (float32 or bf16), in the arena."""
from __future__ import annotations

import ml_dtypes
import numpy as np

from ..loader import Checkpoint, expected_shapes
from ..loader.upload import DeviceWeights, upload

# Kept in float32 whatever the build: the kernels read them as float (norm weights, mHC, ape, sinks, bias).
_FLOAT32_SUFFIXES = ("norm.weight", ".ape", ".attn_sink", "gate.bias")


def stays_float32(name: str) -> bool:
    return name.endswith(_FLOAT32_SUFFIXES) or name.split(".")[-1].startswith("hc_")


class Converted:
    """The upload source: each tensor dequantised and cast to the build's storage type."""

    def __init__(self, ck: Checkpoint, dtype):
        self.ck, self.dtype = ck, np.dtype(dtype)
        self._names = list(expected_shapes(ck.config))
        self._done: dict[str, np.ndarray] = {}  # upload reads each tensor several times

    def names(self) -> list[str]:
        return self._names

    def raw(self, name: str) -> np.ndarray:
        if name not in self._done:
            if name.endswith("tid2eid"):
                x = self.ck.raw(name).astype(np.int32)
            else:
                x = self.ck.float32(name)
                x = x if stays_float32(name) else x.astype(self.dtype)
            self._done[name] = np.ascontiguousarray(x)
        return self._done[name]


def load_weights(ck: Checkpoint, dtype, arena, stream) -> DeviceWeights:
    if np.dtype(dtype) not in (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)):
        raise ValueError(f"GPU builds store float32 or bfloat16, not {np.dtype(dtype)}")
    return upload(Converted(ck, dtype), arena, stream)
