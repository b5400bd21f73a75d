"""One generation request: its tokens, sampling settings, random stream and progress."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Hashable

import numpy as np

from ..kv.plan import BLOCK_POSITIONS
from ..reference.sampling import SamplingParams
from .prefix import block_hashes


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
    sample_seed: int = field(init=False)
    arrived: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    token_times: list[float] = field(default_factory=list)   # when each token was sampled (EOS too)
    prefix_key: bytes | None = None      # the prefix cache entry it resumed from and holds
    resume: object | None = None         # that entry's snapshot, for the runner to restore before the next step
    _hashes: list[bytes] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self):
        # each request owns its stream, so its samples do not depend on what it is batched with
        self.rng = np.random.default_rng(self.params.seed)
        # the GPU sampler's stream is keyed by (sample_seed, tokens generated so far)
        self.sample_seed = self.params.seed if self.params.seed is not None else \
            int(np.random.SeedSequence().entropy % (1 << 63))

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.generated)

    @property
    def remaining(self) -> int:
        """Tokens the model has yet to consume."""
        return len(self.prompt) + len(self.generated) - self.computed

    @property
    def max_len(self) -> int:
        return len(self.prompt) + self.params.max_new_tokens

    @property
    def done(self) -> bool:
        return self.status in (Status.FINISHED, Status.ABORTED)

    def token(self, i: int) -> int:
        """Token i of prompt + generated."""
        n = len(self.prompt)
        return self.prompt[i] if i < n else self.generated[i - n]

    def tokens(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + generated."""
        n = len(self.prompt)
        if stop <= n:
            return self.prompt[start:stop]
        return self.prompt[start:] + self.generated[max(0, start - n):stop - n]

    def prefix_hashes(self, stop: int) -> list[bytes]:
        """Chained hashes of the full blocks of tokens [0, stop); earlier ones are kept, tokens never change."""
        if len(self._hashes) < stop // BLOCK_POSITIONS:
            self._hashes = block_hashes(self.tokens(0, stop), self._hashes)
        return self._hashes[:stop // BLOCK_POSITIONS]
