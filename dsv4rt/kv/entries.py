"""Bytes of one cache entry as the kernels store it: the sizes the cache plan and the launchers share."""
from __future__ import annotations

import numpy as np

KV_BLOCK = 64                  # kKvBlock of cuda_src/kv_fp8.cuh: nope dims per e8m0 scale
FP4_BLOCK = 32                 # kFp4Block of cuda_src/indexer_fp4.cuh: values per e8m0 scale of an indexer key


def packed_kv(dtype, fp8_kv: bool) -> bool:
    """Whether the main-cache entries are the packed 584-byte layout (faithful numerics, bf16 build)."""
    return fp8_kv and np.dtype(dtype).itemsize == 2


def packed_kv_bytes(head_dim: int, rope_dim: int) -> int:
    """Bytes of one packed fp8 main-cache entry (reference.layouts.encode_kv): e4m3 nope dims, bf16 rope dims, one
    e8m0 scale per KV_BLOCK nope dims, padding to 8 B."""
    nope = head_dim - rope_dim
    return -(-(nope + 2 * rope_dim + -(-nope // KV_BLOCK)) // 8) * 8


def fp4_key_bytes(dim: int) -> int:
    """Bytes of one fp4 indexer key (reference.layouts.encode_indexer_key): e2m1 pairs, one e8m0 scale per
    FP4_BLOCK values."""
    return dim // 2 + -(-dim // FP4_BLOCK)


def kv_entry_bytes(dtype, head_dim: int, rope_dim: int, fp8_kv: bool = False) -> int:
    """Bytes of one main-cache entry (window row or compressed entry) as the kernels store it; a cache's
    entries may lie further apart.

    fp8_kv (faithful numerics, docs/numerics.md#kv-cache-rounding) stores the nope dims rounded onto e4m3 with a ue8m0
    scale per 64 dims. The bf16 build packs them as reference.layouts.encode_kv does (584 B at head_dim
    512: e4m3 codes, rope dims in bf16, scale bytes, padding to 8 B). The float32 build, the one checked
    against the float32 faithful reference at 1e-4, keeps float32 rows whose nope dims hold the dequantised
    e4m3 values and whose rope dims stay unrounded: exactly the values of reference.quant.kv_round, with the
    same size and reads as the exact float32 build. (Packing there would round the rope dims to bf16, a
    2e-3 error the reference does not make.)"""
    if not packed_kv(dtype, fp8_kv):
        return head_dim * np.dtype(dtype).itemsize
    return packed_kv_bytes(head_dim, rope_dim)


def indexer_entry_bytes(dtype, dim: int, fp4_keys: bool = False) -> int:
    """Bytes of one indexer-key entry as the kernels store it; a cache's entries may lie further apart.

    fp4_keys (faithful numerics, docs/numerics.md#indexer-rounding) stores the key after the Hadamard rotation as e2m1
    codes (two per byte, low nibble = even index) and one e8m0 scale byte per 32 values: the bytes of
    reference.layouts.encode_indexer_key, 68 at dim 128, in both builds. Unlike the main cache, whose float32
    build keeps float32 rows because packing would round the rope dims to bf16, nothing here is left unrounded:
    the entry holds exactly reference.quant.indexer_round's values, and dequantising it is exact in float32 and
    in bf16, so the float32 build scores in exact float32 on the reference's values from the same 68 bytes."""
    if fp4_keys:
        return fp4_key_bytes(dim)
    return dim * np.dtype(dtype).itemsize
