"""Token sampling on the GPU (twin: dsv4rt/reference/sampling.py): greedy, temperature, top-k, top-p."""
from __future__ import annotations

import ctypes

from ..cuda.device import Device, Launch

# Blocks per row (a cluster) by batch rows: each block fills an SM's shared memory, so small batches spread a
# row over several SMs and large ones give it one; a cluster's blocks share a GPC (16-18 SMs on H200).
CLUSTERS = ((8, 8), (24, 4), (64, 2))
THREADS = 512
MAX_COPIES = 16384  # member copies per block, 12 bytes each of shared memory
_KERNELS = tuple(f"sample_tokens<{c}>" for c in (1, 2, 4, 8))


def blocks_per_row(rows: int) -> int:
    return next((c for most, c in CLUSTERS if rows <= most), 1)


def sample(device: Device, out: int, logits: int, rows: int, vocab: int, temperature: int, top_k: int,
           top_p: int, seed: int, step: int) -> Launch:
    """out int32 [rows] ← one token per row of fp32 logits [rows, vocab]. Per-row parameters are device
    arrays, refilled between graph replays: temperature fp32 (0: greedy), top_k int32 (0: off), top_p fp32
    (≥ 1: off), seed and step uint64. The draw is a function of (logits, parameters, seed, step) alone."""
    c = blocks_per_row(rows)
    k = device.kernel("sample", f"sample_tokens<{c}>", _KERNELS)
    share = -(-vocab // c)
    threads = min(THREADS, max(32, -(-share // 4 // 32) * 32))  # a few logits per thread, whole warps
    capacity = min(MAX_COPIES, -(-share // 32) * 32)
    shared = 12 * capacity
    k.allow_shared(shared)
    P = ctypes.c_void_p
    return k.bind(rows * c, threads, [P(out), P(logits), ctypes.c_int(vocab), P(temperature), P(top_k), P(top_p),
                                      P(seed), P(step), ctypes.c_int(capacity)], shared=shared)

