"""Token sampling on the GPU (twin: dsv4rt/reference/sampling.py): greedy, temperature, top-k, top-p."""
from __future__ import annotations

import ctypes

from ..cuda.device import Device, Launch


def sample(device: Device, out: int, logits: int, rows: int, vocab: int, temperature: int, top_k: int,
           top_p: int, seed: int, step: int) -> Launch:
    """out int32 [rows] ← one token per row of fp32 logits [rows, vocab]. Per-row parameters are device
    arrays, refilled between graph replays: temperature fp32 (0: greedy), top_k int32 (0: off), top_p fp32
    (≥ 1: off), seed and step uint64. The draw is a function of (logits, parameters, seed, step) alone."""
    k = device.kernel("sample", "sample_tokens")
    threads = min(1024, max(32, -(-vocab // 4 // 32) * 32))  # a few logits per thread, whole warps
    P = ctypes.c_void_p
    return k.bind(rows, threads, [P(out), P(logits), ctypes.c_int(vocab), P(temperature), P(top_k), P(top_p),
                                  P(seed), P(step)])
