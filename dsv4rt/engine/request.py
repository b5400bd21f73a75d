"""One generation request: its tokens, sampling settings, random stream and progress."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Hashable

import numpy as np

from ..reference.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False)
class Request:
    id: Hashable
    prompt: list[int]
    params: SamplingParams
    generated: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None     # "stop" (EOS), "length" (max_new_tokens) or "abort"
    computed: int = 0                    # tokens (prompt + generated) the model has consumed
    rng: np.random.Generator = field(init=False)
    arrived: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None

    def __post_init__(self):
        # each request owns its stream, so its samples do not depend on what it is batched with
        self.rng = np.random.default_rng(self.params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.generated)

    @property
    def remaining(self) -> int:
        """Tokens the model has yet to consume."""
        return self.num_tokens - self.computed

    @property
    def max_len(self) -> int:
        return len(self.prompt) + self.params.max_new_tokens

    @property
    def done(self) -> bool:
        return self.status in (Status.FINISHED, Status.ABORTED)

    def tokens(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + generated."""
        n = len(self.prompt)
        if stop <= n:
            return self.prompt[start:stop]
        return self.prompt[start:] + self.generated[max(0, start - n):stop - n]
