"""The collectives of a step (docs/parallel.md#a-step), simulated in numpy: every function takes one entry per rank,
in rank order, and returns what each rank receives. Sums run in rank order, so a simulated run is deterministic."""
from __future__ import annotations

import numpy as np


def all_reduce(parts: list[np.ndarray]) -> list[np.ndarray]:
    total = _sum(parts)
    return [total] * len(parts)


def all_gather(parts: list[np.ndarray], axis: int = 0) -> list[np.ndarray]:
    whole = np.concatenate(parts, axis=axis)
    return [whole] * len(parts)


def reduce_scatter(parts: list[np.ndarray], bounds: list[tuple[int, int]], axis: int = 0) -> list[np.ndarray]:
    """Rank r receives the sum's [bounds[r][0], bounds[r][1]) along `axis`."""
    total = _sum(parts)
    return [total.take(np.arange(a, b), axis=axis) for a, b in bounds]


def all_to_all(send: list[list]) -> list[list]:
    """send[s][d] is what rank s sends rank d; rank d receives [send[0][d], send[1][d], ...]."""
    n = len(send)
    return [[send[s][d] for s in range(n)] for d in range(n)]


def _sum(parts: list[np.ndarray]) -> np.ndarray:
    total = parts[0].copy()
    for p in parts[1:]:
        total += p
    return total
