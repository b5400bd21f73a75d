"""Token sampling on the host: greedy, temperature, top-k, top-p."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..files import is_int


@dataclass
class SamplingParams:
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 0            # 0: no top-k cut
    max_new_tokens: int = 512
    seed: int | None = None

    def check(self, name=lambda field: field) -> "SamplingParams":
        """Raises ValueError naming the first bad field, spelled by `name` (the CLI passes its option names)."""
        def bad(field, rule):
            value = getattr(self, field)
            shown = repr(value) if isinstance(value, str) else value  # numpy scalars print as plain numbers
            return ValueError(f"{name(field)} must be {rule}, got {shown}")
        if not _number(self.temperature) or not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise bad("temperature", "a finite number >= 0")
        if not _number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "in (0, 1]")
        if not _integer(self.top_k) or self.top_k < 0:
            raise bad("top_k", "an integer >= 0")
        if not _integer(self.max_new_tokens) or self.max_new_tokens < 1:
            raise bad("max_new_tokens", "an integer >= 1")
        if self.seed is not None and (not _integer(self.seed) or not 0 <= self.seed < 2 ** 64):
            raise bad("seed", "an integer from 0 to 2**64 - 1")
        return self


def _integer(v) -> bool:
    return is_int(v) or isinstance(v, np.integer)


def _number(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


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
