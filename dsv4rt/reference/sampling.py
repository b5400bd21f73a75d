"""Token sampling on the host: greedy, temperature, top-k, top-p."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class SamplingParams:
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 0            # 0: no top-k cut
    max_new_tokens: int = 512
    seed: int | None = None

    def check(self) -> "SamplingParams":
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        return self


def sample(logits: np.ndarray, p: SamplingParams, rng: np.random.Generator) -> int:
    """One token from a [vocab] row of logits."""
    if p.temperature == 0:
        return int(np.argmax(logits))
    x = logits.astype(np.float64) / p.temperature
    order = np.argsort(-x, kind="stable")
    if p.top_k:
        order = order[:p.top_k]
    probs = np.exp(x[order] - x[order[0]])
    probs /= probs.sum()
    keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)  # smallest prefix with mass >= top_p
    probs = probs[:keep] / probs[:keep].sum()
    return int(order[rng.choice(len(probs), p=probs)])
