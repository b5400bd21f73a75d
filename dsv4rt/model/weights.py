"""A checkpoint's tensors in the storage type of a GPU build (float32 or bf16), in the arena; or, raw, with the
fp8/fp4 weights and their block scales as released."""
from __future__ import annotations

import ml_dtypes
import numpy as np

from ..loader import Checkpoint, CheckpointError, expected_shapes, scale_name
from ..loader.safetensors import DTYPES
from ..loader.upload import DeviceWeights, upload

# Kept in float32 whatever the build: the kernels read them as float (norm weights, mHC, ape, sinks, bias).
_FLOAT32_SUFFIXES = ("norm.weight", ".ape", ".attn_sink", "gate.bias")
E8M0 = DTYPES["F8_E8M0"]


def stays_float32(name: str) -> bool:
    return name.endswith(_FLOAT32_SUFFIXES) or name.split(".")[-1].startswith("hc_")


def e8m0_bytes(scale: np.ndarray, name: str) -> np.ndarray:
    """Block scales as e8m0 (2^(byte − 127)): e8m0 or uint8 as stored, float scales that are powers of two
    re-encoded (some exports write them as float32)."""
    if scale.dtype in (E8M0, np.dtype(np.uint8)):
        return scale
    mantissa, exponent = np.frexp(scale.astype(np.float32))
    byte = exponent.astype(np.int64) + 126
    if not (np.all(mantissa == 0.5) and np.all((0 <= byte) & (byte <= 254))):
        raise CheckpointError(f"{name}: block scales that are not powers of two in [2^-127, 2^127] have no e8m0 form")
    return byte.astype(np.uint8).view(E8M0)


class Converted:
    """The upload source: each tensor dequantised and cast to the build's storage type. With `keep_quantized`,
    fp8 e4m3 and packed fp4 e2m1 weights stay as stored, joined by their `.scale`
    tensors as e8m0."""

    def __init__(self, ck: Checkpoint, dtype, keep_quantized: bool = False):
        self.ck, self.dtype = ck, np.dtype(dtype)
        self._names = list(expected_shapes(ck.config))
        quantized = [n for n in self._names if keep_quantized and ck.is_quantized(n)]
        self._stored = set(quantized)
        self._scales = {scale_name(n) for n in quantized}
        self._names += sorted(self._scales)
        self._done: dict[str, np.ndarray] = {}  # upload reads each tensor several times

    def names(self) -> list[str]:
        return self._names

    def raw(self, name: str) -> np.ndarray:
        if name not in self._done:
            if name in self._stored:
                x = self.ck.raw(name)
            elif name in self._scales:
                x = e8m0_bytes(self.ck.raw(name), name)
            elif name.endswith("tid2eid"):
                x = self.ck.raw(name).astype(np.int32)
            else:
                x = self.ck.float32(name)
                x = x if stays_float32(name) else x.astype(self.dtype)
            self._done[name] = np.ascontiguousarray(x)
        return self._done[name]


def load_weights(ck: Checkpoint, dtype, arena, stream, raw: bool = False) -> DeviceWeights:
    """Every tensor the model needs in the build's storage type. raw: fp8/fp4 weights byte for byte as
    stored (e4m3 [out, in]; int8 [out, in/2], low nibble = even column) and, under their official
    `.scale` names, their e8m0 scales (per 128 x 128 tile; per 1 x 32), with no dequantised copy; every other tensor
    as without."""
    if np.dtype(dtype) not in (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)):
        raise ValueError(f"GPU builds store float32 or bfloat16, not {np.dtype(dtype)}")
    return upload(Converted(ck, dtype, keep_quantized=raw), arena, stream)
