"""Block-scaled fp8 e4m3 and packed fp4 e2m1 weights: decoding for the CPU path, encoding for tiny models."""
from __future__ import annotations

import ml_dtypes
import numpy as np

from .safetensors import DTYPES

E4M3_MAX, E2M1_MAX = 448.0, 6.0
FP8_BLOCK, FP4_BLOCK = 128, 32
E2M1_VALUES = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
_E8M0 = DTYPES["F8_E8M0"]


def fp8_scale_shape(shape: tuple[int, int], block: int = FP8_BLOCK) -> tuple[int, int]:
    return -(-shape[0] // block), -(-shape[1] // block)


def fp4_scale_shape(shape: tuple[int, int], block: int = FP4_BLOCK) -> tuple[int, int]:
    """`shape` is the logical (unpacked) shape."""
    return shape[0], -(-shape[1] // block)


def e8m0_to_float32(scale: np.ndarray) -> np.ndarray:
    """Scales as float32: e8m0 (or its raw bytes as uint8) decode to 2^(byte-127), float scales pass through."""
    if scale.dtype not in (_E8M0, np.dtype(np.uint8)):
        return scale.astype(np.float32)
    b = scale.view(np.uint8)
    nan = b == 255
    return np.where(nan, np.float32(np.nan), np.ldexp(np.float32(1), np.where(nan, 0, b.astype(np.int32) - 127)))


def dequant_fp8(w: np.ndarray, scale: np.ndarray, block: int = FP8_BLOCK) -> np.ndarray:
    """fp8 e4m3 [out, in] with one scale per block x block tile -> float32 [out, in]."""
    if w.ndim != 2:
        raise ValueError(f"fp8 weight must be 2-D, got {list(w.shape)}")
    _check_scale("fp8", w.shape, fp8_scale_shape(w.shape, block), scale)
    return w.astype(np.float32) * _expand(e8m0_to_float32(scale), block, block, w.shape)


def dequant_fp4(packed: np.ndarray, scale: np.ndarray, block: int = FP4_BLOCK) -> np.ndarray:
    """Packed e2m1 [out, in/2] (low nibble = even column) with one scale per 1 x block -> float32 [out, in]."""
    if packed.ndim != 2:
        raise ValueError(f"packed fp4 weight must be 2-D, got {list(packed.shape)}")
    shape = (packed.shape[0], 2 * packed.shape[1])
    _check_scale("fp4", shape, fp4_scale_shape(shape, block), scale)
    b = packed.view(np.uint8)
    out = np.empty(shape, np.float32)
    out[:, 0::2] = E2M1_VALUES[b & 15]
    out[:, 1::2] = E2M1_VALUES[b >> 4]
    return out * _expand(e8m0_to_float32(scale), 1, block, shape)


def quant_fp8(x: np.ndarray, block: int = FP8_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """float32 [out, in] -> (e4m3 [out, in], e8m0 scales per block x block tile)."""
    x = _matrix(x)
    e = _pow2_exponent(_block_amax(x, block, block), E4M3_MAX)
    q = (x / _expand(np.ldexp(np.float32(1), e), block, block, x.shape)).astype(ml_dtypes.float8_e4m3fn)
    return q, _to_e8m0(e)


def quant_fp4(x: np.ndarray, block: int = FP4_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """float32 [out, in] (in even) -> (int8 [out, in/2] two e2m1 codes per byte, e8m0 scales per 1 x block)."""
    x = _matrix(x)
    if x.shape[1] % 2:
        raise ValueError(f"fp4 packing needs an even number of columns, got {list(x.shape)}")
    e = _pow2_exponent(_block_amax(x, 1, block), E2M1_MAX)
    q = (x / _expand(np.ldexp(np.float32(1), e), 1, block, x.shape)).astype(ml_dtypes.float4_e2m1fn)
    codes = q.view(np.uint8) & 15
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(np.int8), _to_e8m0(e)


def _check_scale(kind: str, shape, want: tuple[int, int], scale: np.ndarray):
    if scale.shape != want:
        raise ValueError(f"{kind} weight {list(shape)} needs a scale of {list(want)}, got {list(scale.shape)}")


def _matrix(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float32)
    if x.ndim != 2:
        raise ValueError(f"can only quantise 2-D weights, got {list(x.shape)}")
    if not np.isfinite(x).all():
        raise ValueError("cannot quantise non-finite values")
    return x


def _expand(s: np.ndarray, rows: int, cols: int, shape: tuple[int, int]) -> np.ndarray:
    return np.repeat(np.repeat(s, rows, 0), cols, 1)[: shape[0], : shape[1]]


def _block_amax(x: np.ndarray, rows: int, cols: int) -> np.ndarray:
    # a trailing partial block is padded with zeros, so its scale comes from its own elements
    R, C = -(-x.shape[0] // rows), -(-x.shape[1] // cols)
    p = np.zeros((R * rows, C * cols), np.float32)
    p[: x.shape[0], : x.shape[1]] = np.abs(x)
    return p.reshape(R, rows, C, cols).max(axis=(1, 3))


def _pow2_exponent(amax: np.ndarray, qmax: float) -> np.ndarray:
    """Smallest e with qmax * 2^e >= amax (amax floored so that 2^e stays a normal float32)."""
    amax = np.maximum(amax.astype(np.float64), qmax * 2.0 ** -126)
    e = np.ceil(np.log2(amax / qmax)).astype(np.int32)
    e -= np.ldexp(qmax, e - 1) >= amax  # log2 may round either way; settle the exact power
    e += np.ldexp(qmax, e) < amax
    return e


def _to_e8m0(e: np.ndarray) -> np.ndarray:
    return (e + 127).astype(np.uint8).view(_E8M0)
