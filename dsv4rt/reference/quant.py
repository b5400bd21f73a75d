"""Faithful-mode roundings (docs/numerics.md): e4m3 and e2m1 grids with power-of-two (ue8m0) scales."""
from __future__ import annotations

import numpy as np

E4M3_MAX, E2M1_MAX = 448.0, 6.0


def _round_grid(x: np.ndarray, mant_bits: int, min_exp: int, top: float) -> np.ndarray:
    """Round to a float grid with `mant_bits` stored mantissa bits, ties to even, saturating at `top`."""
    a = np.abs(x)
    _, e = np.frexp(a)  # a = m * 2^e with m in [0.5, 1): floor(log2 a) = e - 1, exact
    ulp = np.ldexp(np.ones_like(a), np.maximum(e - 1, min_exp) - mant_bits)
    r = np.minimum(np.rint(a / ulp) * ulp, top)
    return np.copysign(r, x).astype(x.dtype)


def round_e4m3(x: np.ndarray) -> np.ndarray:
    return _round_grid(x, 3, -6, E4M3_MAX)


def round_e2m1(x: np.ndarray) -> np.ndarray:
    return _round_grid(x, 1, 0, E2M1_MAX)


def pow2_scale(amax: np.ndarray, top: float) -> np.ndarray:
    """2^ceil(log2(amax / top)), computed exactly with frexp."""
    m, e = np.frexp((amax / top).astype(np.float32))
    return np.ldexp(np.float32(1), np.where(m == 0.5, e - 1, e)).astype(np.float32)


def _blockwise(x: np.ndarray, block: int, fn) -> np.ndarray:
    """Apply fn to consecutive blocks of the last axis; the last block may be shorter."""
    n = x.shape[-1]
    if n <= block:
        return fn(x)
    full = n - n % block
    head = fn(x[..., :full].reshape(*x.shape[:-1], full // block, block)).reshape(*x.shape[:-1], full)
    if full == n:
        return head
    return np.concatenate([head, fn(x[..., full:])], axis=-1)


def _fake_quant(x: np.ndarray, block: int, floor: float, top: float, rounder) -> np.ndarray:
    def one(b):
        amax = np.maximum(np.abs(b).max(axis=-1, keepdims=True), floor)
        s = pow2_scale(amax, top)
        return rounder(b / s) * s
    return _blockwise(x.astype(np.promote_types(x.dtype, np.float32)), block, one)  # float64 stays float64


def act_quant(x: np.ndarray, block: int = 128) -> np.ndarray:
    """e4m3 with a ue8m0 scale per `block` values, returned dequantised."""
    return _fake_quant(x, block, 1e-4, E4M3_MAX, round_e4m3)


def fp4_quant(x: np.ndarray, block: int = 32) -> np.ndarray:
    """e2m1 with a ue8m0 scale per `block` values, returned dequantised."""
    return _fake_quant(x, block, E2M1_MAX * 2.0 ** -126, E2M1_MAX, round_e2m1)


def kv_round(kv: np.ndarray, rope_dim: int) -> np.ndarray:
    """The cached-KV rounding: nope dims onto e4m3 with a scale per 64, rope dims untouched."""
    nope = kv.shape[-1] - rope_dim
    return np.concatenate([act_quant(kv[..., :nope], 64), kv[..., nope:]], axis=-1)


def hadamard(n: int) -> np.ndarray:
    """Orthonormal Walsh-Hadamard matrix in Sylvester order, n a power of two."""
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.float32(np.sqrt(n))


def rotate(x: np.ndarray) -> np.ndarray:
    """x·H over the last axis; other widths are zero-padded to a power of two and truncated, as upstream."""
    d = x.shape[-1]
    n = 1 << (d - 1).bit_length()
    if n != d:
        x = np.concatenate([x, np.zeros((*x.shape[:-1], n - d), x.dtype)], axis=-1)
    return (x @ hadamard(n))[..., :d]


def indexer_round(x: np.ndarray) -> np.ndarray:
    return fp4_quant(rotate(x), 32)
