"""Byte layouts of the faithful-mode caches (docs/caches.md#entry-layouts), the twins of the GPU cache writers.

Main KV entry, 584 B for head_dim 512: the (hd - rd) nope values as e4m3, the rd rope values as
bf16, one e8m0 scale per 64 nope values, padding to a multiple of 8. Indexer key, 68 B for 128
dims: e2m1 pairs (low nibble = even index) and one e8m0 scale per 32 values. Decoding an encoded
entry gives exactly what the reference computes with quant.kv_round (nope dims; the rope dims come
back rounded to bf16, where the float32 reference keeps them in float32) and quant.indexer_round."""
from __future__ import annotations

import ml_dtypes
import numpy as np

from ..kv.entries import FP4_BLOCK as INDEX_BLOCK, KV_BLOCK
from ..kv.entries import fp4_key_bytes as indexer_entry_bytes, packed_kv_bytes as kv_entry_bytes
from .quant import E2M1_MAX, E4M3_MAX, pow2_scale, rotate, round_e2m1

_E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def _scales(x: np.ndarray, block: int, floor: float, top: float) -> np.ndarray:
    """Per-block power-of-two scales [n, blocks]; the last block may be shorter."""
    n, d = x.shape
    pad = np.zeros((n, -(-d // block) * block), np.float32)
    pad[:, :d] = np.abs(x)
    return pow2_scale(np.maximum(pad.reshape(n, -1, block).max(axis=-1), floor), top)


def _e8m0(scale: np.ndarray) -> np.ndarray:
    return (np.frexp(scale)[1] - 1 + 127).astype(np.uint8)


def _from_e8m0(b: np.ndarray) -> np.ndarray:
    return np.ldexp(np.float32(1), b.astype(np.int32) - 127)


def encode_kv(kv: np.ndarray, rope_dim: int) -> np.ndarray:
    """[n, head_dim] float32 (after RoPE) -> [n, kv_entry_bytes] uint8."""
    n, hd = kv.shape
    nope = hd - rope_dim
    s = _scales(kv[:, :nope], KV_BLOCK, 1e-4, E4M3_MAX)
    per_value = np.repeat(s, KV_BLOCK, axis=1)[:, :nope]
    out = np.zeros((n, kv_entry_bytes(hd, rope_dim)), np.uint8)
    out[:, :nope] = (kv[:, :nope] / per_value).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    out[:, nope:nope + 2 * rope_dim] = kv[:, nope:].astype(ml_dtypes.bfloat16).view(np.uint8).reshape(n, -1)
    out[:, nope + 2 * rope_dim:nope + 2 * rope_dim + s.shape[1]] = _e8m0(s)
    return out


def decode_kv(entries: np.ndarray, head_dim: int, rope_dim: int) -> np.ndarray:
    n, nope = len(entries), head_dim - rope_dim
    blocks = -(-nope // KV_BLOCK)
    s = _from_e8m0(entries[:, nope + 2 * rope_dim:nope + 2 * rope_dim + blocks])
    values = entries[:, :nope].copy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    rope = entries[:, nope:nope + 2 * rope_dim].copy().view(ml_dtypes.bfloat16).astype(np.float32)
    return np.concatenate([values * np.repeat(s, KV_BLOCK, axis=1)[:, :nope], rope.reshape(n, rope_dim)], axis=1)


def encode_indexer_key(k: np.ndarray) -> np.ndarray:
    """[n, dim] float32 (after RoPE) -> Hadamard rotation, e2m1 codes and scales: [n, indexer_entry_bytes]."""
    n, d = k.shape
    r = rotate(k)
    s = _scales(r, INDEX_BLOCK, E2M1_MAX * 2.0 ** -126, E2M1_MAX)
    q = round_e2m1(r / np.repeat(s, INDEX_BLOCK, axis=1)[:, :d])
    codes = np.searchsorted(_E2M1[:8], np.abs(q)).astype(np.uint8) | (np.signbit(q) << 3).astype(np.uint8)
    out = np.zeros((n, indexer_entry_bytes(d)), np.uint8)
    out[:, :d // 2] = codes[:, 0::2] | (codes[:, 1::2] << 4)
    out[:, d // 2:] = _e8m0(s)
    return out


def decode_indexer_key(entries: np.ndarray, dim: int) -> np.ndarray:
    packed = entries[:, :dim // 2]
    values = np.empty((len(entries), dim), np.float32)
    values[:, 0::2], values[:, 1::2] = _E2M1[packed & 15], _E2M1[packed >> 4]
    return values * np.repeat(_from_e8m0(entries[:, dim // 2:]), INDEX_BLOCK, axis=1)[:, :dim]
