"""Continuous batching with chunked prefill over the paged KV cache, first come first served.

A step spends the token budget in this order:
1. single-token work (decodes) of running requests, in admission order: one token each, so the
   inter-token latency of running requests stays flat however long the prompts that stream in;
2. prefill chunks of running requests, in admission order, each cut to the budget left;
3. waiting requests, admitted in arrival order (none overtakes the head of the queue) while
   `max_running` allows and their first chunk's pages fit without preempting anyone.

Pages are claimed in admission order. When a running request cannot get the pages of its next
tokens, the most recently admitted running request (possibly itself) is preempted: its pages are
released, `computed` goes back to 0 and it returns to the front of the waiting queue, to recompute
prompt + generated tokens later. The oldest request thus always progresses, and since `add`
rejects requests that would not fit in the empty cache, every request eventually completes.
"""
from __future__ import annotations

from collections import deque
from typing import Hashable

from ..kv.blocks import BlockManager
from .request import Request, Status

Step = list[tuple[Request, int]]


class Scheduler:
    def __init__(self, blocks: BlockManager, token_budget: int, max_running: int):
        if token_budget < 1 or max_running < 1:
            raise ValueError(f"token_budget ({token_budget}) and max_running ({max_running}) must be >= 1")
        self.blocks, self.token_budget, self.max_running = blocks, token_budget, max_running
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: Request) -> None:
        if not self.blocks.fits_ever(request.max_len, self.token_budget):
            raise ValueError(
                f"request {request.id!r} can never fit: {len(request.prompt)} prompt + {request.params.max_new_tokens} "
                f"new tokens need more than the whole KV cache ({self.blocks.allocator.total_bytes} B); "
                f"shorten the prompt, lower max_new_tokens or enlarge the cache")
        request.status = Status.WAITING
        self.waiting.append(request)

    def schedule(self) -> Step:
        """The next step: (request, new tokens) pairs, decodes first; their pages are placed."""
        budget = self.token_budget
        planned: dict[Hashable, int] = {}
        for single in (True, False):
            for r in self.running:
                if budget and (r.remaining == 1) == single:
                    planned[r.id] = min(r.remaining, budget)
                    budget -= planned[r.id]
        step = self._claim_running(planned)
        while self.waiting and budget and len(self.running) < self.max_running:
            r = self.waiting[0]
            n = min(r.remaining, budget)
            if not self.blocks.can_place(r.id, r.computed + n):
                break
            self.blocks.place(r.id, r.computed + n)
            self.waiting.popleft()
            r.status = Status.RUNNING
            self.running.append(r)
            step.append((r, n))
            budget -= n
        step.sort(key=lambda entry: entry[0].remaining != 1)   # stable: decodes first, each part in admission order
        return step

    def finish(self, request: Request, reason: str) -> None:
        """The request is complete: its pages go back at once."""
        self.running.remove(request)
        self.blocks.release(request.id)
        request.status, request.finish_reason = Status.FINISHED, reason

    def abort(self, request_id: Hashable) -> Request | None:
        """Drop a live request and free its pages; None when no live request has that id."""
        for queue in (self.running, self.waiting):
            for r in queue:
                if r.id == request_id:
                    queue.remove(r)
                    if r.id in self.blocks:
                        self.blocks.release(r.id)
                    r.status, r.finish_reason = Status.ABORTED, "abort"
                    return r
        return None

    def _claim_running(self, planned: dict[Hashable, int]) -> Step:
        # Admission order: a victim (taken from the end) has never been placed in this step.
        step, i = [], 0
        while i < len(self.running):
            r = self.running[i]
            n = planned.get(r.id)
            if n is None:
                i += 1
                continue
            while not self.blocks.can_place(r.id, r.computed + n) and self.running[-1] is not r:
                self._preempt(self.running[-1])
            if not self.blocks.can_place(r.id, r.computed + n):
                self._preempt(r)          # it is the last one: nothing after it to claim
                break
            self.blocks.place(r.id, r.computed + n)
            step.append((r, n))
            i += 1
        return step

    def _preempt(self, r: Request) -> None:
        self.running.remove(r)
        self.blocks.release(r.id)
        r.computed, r.status = 0, Status.WAITING
        self.waiting.appendleft(r)
        self.preemptions += 1
