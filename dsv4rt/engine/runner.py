"""Model runners: they execute a scheduled step and return each request's next-token logits."""
from __future__ import annotations

import copy
from typing import Hashable, Protocol, Sequence

import numpy as np

from ..reference import Model, SequenceState
from ..reference.sampling import sample
from .scheduler import Step


class Runner(Protocol):
    def run(self, step: Step) -> Sequence[int | None]:
        """Feed each request's tokens [computed, computed + n); per entry, the next token sampled with
        the request's settings when its step reaches its last token (anything otherwise)."""

    def release(self, request_id: Hashable) -> None:
        """Forget a request that finished or was aborted."""

    def snapshot(self, request_id: Hashable) -> object | None:
        """What resuming at the request's current position (a block boundary) needs, independent of it,
        or None when there is no room to keep it. The CPU runner copies the whole state, the GPU runner
        the pages the request holds."""

    def restore(self, request_id: Hashable, snapshot: object) -> None:
        """Set the request's state to a snapshot before its next step; the snapshot stays unchanged."""

    def discard(self, snapshot: object) -> None:
        """The prefix cache dropped this snapshot."""


class CpuRunner:
    """The reference model, one SequenceState per request, fed request by request."""

    def __init__(self, model: Model):
        self.model = model
        self.states: dict[Hashable, SequenceState] = {}

    def run(self, step: Step) -> list[int | None]:
        out = []
        for request, n in step:
            if request.computed == 0:      # new, or preempted: recompute from the first token
                self.states[request.id] = self.model.new_state()
            state = self.states[request.id]
            if state.pos != request.computed:
                raise RuntimeError(f"request {request.id!r}: state at {state.pos}, scheduled from {request.computed}")
            ids = request.tokens(request.computed, request.computed + n)
            logits = self.model.forward(state, np.array(ids, np.int64))[-1]
            out.append(sample(logits, request.params, request.rng) if request.computed + n == request.num_tokens
                       else None)
        return out

    def release(self, request_id: Hashable) -> None:
        self.states.pop(request_id, None)

    def snapshot(self, request_id: Hashable) -> SequenceState:
        return copy.deepcopy(self.states[request_id])

    def restore(self, request_id: Hashable, snapshot: SequenceState) -> None:
        # a copy again: the states grow in place, and several requests may resume from one snapshot
        self.states[request_id] = copy.deepcopy(snapshot)

    def discard(self, snapshot: SequenceState) -> None:
        pass
