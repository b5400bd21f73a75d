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

With a prefix cache, a request is admitted at the longest cached block boundary of its tokens (at least
one token is left to compute, for its logits), and a chunk that crosses block boundaries ends at the
last of them: the runner snapshots a request's state at step ends only, so the cache keeps the furthest
boundary each chunk reaches (the whole history, for the next turn of a chat).
"""
from __future__ import annotations

from collections import deque
from typing import Hashable

from ..kv.blocks import BlockManager
from ..kv.plan import BLOCK_POSITIONS
from .prefix import PrefixCache
from .request import Request, Status

Step = list[tuple[Request, int]]


class Scheduler:
    def __init__(self, blocks: BlockManager, token_budget: int, max_running: int, prefix: PrefixCache | None = None):
        if token_budget < 1 or max_running < 1:
            raise ValueError(f"token_budget ({token_budget}) and max_running ({max_running}) must be >= 1")
        self.blocks, self.token_budget, self.max_running = blocks, token_budget, max_running
        self.prefix = prefix
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0
        self._decodes: list[tuple[Request, int, bool]] | None = None   # when the last step decoded every running one

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def check(self, request: Request) -> None:
        """Refuse a request that would not fit even in the empty cache (reads nothing that changes)."""
        if not self.blocks.fits_ever(request.max_len, self.token_budget):
            raise ValueError(
                f"request {request.id!r} can never fit: {len(request.prompt)} prompt + {request.params.max_new_tokens} "
                f"new tokens need more than the whole KV cache ({self.blocks.allocator.total_bytes} B); "
                f"shorten the prompt, lower max_new_tokens or enlarge the cache")

    def add(self, request: Request) -> None:
        self.check(request)
        request.status = Status.WAITING
        self.waiting.append(request)

    def schedule(self) -> Step:
        """The next step: (request, new tokens) pairs, decodes first; their pages are placed. Between
        steps the caller advances each scheduled request by its tokens and gives the next token to those
        whose step reached their last one, or finishes them (Engine.step)."""
        budget, preemptions = self.token_budget, self.preemptions
        if self._decodes is not None and not self.waiting:
            # the last step decoded every running request, so each decodes again: nothing to decide
            planned = self._decodes
            budget -= len(self.running)
        else:
            single = [r.remaining == 1 for r in self.running]
            decodes = min(sum(single), budget)
            budget -= decodes
            planned = []           # (request, tokens, single) in admission order
            for r, one in zip(self.running, single):
                if one:
                    if decodes:
                        planned.append((r, 1, True))
                        decodes -= 1
                elif budget:
                    n = self._chunk(r.computed, r.num_tokens, budget)
                    planned.append((r, n, False))
                    budget -= n
        step, chunks = self._claim_running(planned)
        while self.waiting and budget and len(self.running) < self.max_running:
            r = self.waiting[0]
            n = self._admit(r, budget)
            if not n:
                break
            self.waiting.popleft()
            r.status = Status.RUNNING
            self.running.append(r)
            (step if r.remaining == 1 else chunks).append((r, n))
            budget -= n
        if chunks or len(step) < len(self.running):
            self._decodes = None
        elif planned is not self._decodes or len(planned) > len(step) or self.preemptions > preemptions:
            self._decodes = [(r, 1, True) for r, _ in step]     # finished and aborted ones were skipped
        return step + chunks          # decodes first, each part in admission order

    def finish(self, request: Request, reason: str) -> None:
        """The request is complete: its pages go back at once."""
        self.running.remove(request)
        self._let_go(request)
        request.status, request.finish_reason = Status.FINISHED, reason

    def abort(self, request_id: Hashable) -> Request | None:
        """Drop a live request and free its pages; None when no live request has that id."""
        for queue in (self.running, self.waiting):
            for r in queue:
                if r.id == request_id:
                    queue.remove(r)
                    self._let_go(r)
                    r.status, r.finish_reason = Status.ABORTED, "abort"
                    return r
        return None

    def _claim_running(self, planned: list[tuple[Request, int, bool]]) -> tuple[Step, Step]:
        """Place the planned steps in admission order, preempting from the most recently admitted;
        (decodes, chunks). A victim, taken from the end, has never been placed in this step."""
        decodes, chunks = [], []
        try_place, running = self.blocks.try_place, self.running
        for r, n, one in planned:
            if r.status is not Status.RUNNING:        # preempted for the pages of an earlier one
                continue
            placed = try_place(r.id, r.computed + n)
            while not placed and running[-1] is not r:
                self._preempt(running[-1])
                placed = try_place(r.id, r.computed + n)
            if not placed:
                self._preempt(r)          # it is the last one: nothing after it to claim
                break
            (decodes if one else chunks).append((r, n))
        return decodes, chunks

    def _preempt(self, r: Request) -> None:
        self.running.remove(r)
        self._let_go(r)
        r.computed, r.status, r.resume = 0, Status.WAITING, None
        self.waiting.appendleft(r)
        self.preemptions += 1

    def _chunk(self, computed: int, num_tokens: int, budget: int) -> int:
        n = min(num_tokens - computed, budget)
        if self.prefix is not None:
            boundary = (computed + n) // BLOCK_POSITIONS * BLOCK_POSITIONS
            if boundary > computed:
                n = boundary - computed
        return n

    def _admit(self, r: Request, budget: int) -> int:
        """Place the first chunk of a waiting request, after its longest cached prefix; its size, 0 when pages lack."""
        blocks, snapshot = 0, None
        if self.prefix is not None:
            blocks, snapshot = self.prefix.lookup(r.prefix_hashes(r.num_tokens - 1))
        start = blocks * BLOCK_POSITIONS
        n = self._chunk(start, r.num_tokens, budget)
        if blocks:
            # On the CPU pages are bookkeeping: the request holds its own. Sharing the cached prefix's
            # pages between requests is the GPU runner's work.
            if not self.blocks.can_place(r.id, start):
                return 0
            self.blocks.place(r.id, start)
        if not self.blocks.can_place(r.id, start + n):
            if blocks:
                self.blocks.release(r.id)
            return 0
        self.blocks.place(r.id, start + n)
        if blocks:
            r.computed, r.resume, r.prefix_key = start, snapshot, r.prefix_hashes(start)[-1]
            self.prefix.acquire(r.prefix_key)
        return n

    def _let_go(self, r: Request) -> None:
        """Give back the request's pages and its hold on a prefix cache entry."""
        if r.id in self.blocks:
            self.blocks.release(r.id)
        if r.prefix_key is not None:
            self.prefix.release(r.prefix_key)
            r.prefix_key = None
