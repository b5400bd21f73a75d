"""The engine: requests in, tokens out; each step schedules, runs the model and samples.

`generate` and `stream` go through the engine loop (dsv4rt/engine/loop.py, which documents the
concurrency model), so any number of threads may call them at once; step, add_request and abort take
the engine's lock."""
from __future__ import annotations

import itertools
import threading
from collections import Counter
import time
from dataclasses import dataclass
from typing import Hashable, Iterator, Sequence

from ..chat import EOS, StreamDecoder, load_tokenizer
from ..kv.blocks import BlockManager
from ..kv.plan import BLOCK_POSITIONS, build_plan
from ..kv.slab import DEFAULT_SLAB_BYTES, SlabAllocator
from ..reference import load_model
from ..reference.sampling import SamplingParams
from .prefix import PrefixCache
from .loop import EngineLoop
from .request import Request
from .runner import CpuRunner, Runner
from .scheduler import Scheduler


@dataclass(frozen=True)
class RequestOutput:
    id: Hashable
    prompt_ids: list[int]
    token_ids: list[int]           # without the EOS that ended it
    text: str
    finish_reason: str | None
    first_token_s: float | None    # seconds from add_request to the first generated token


class Engine:
    def __init__(self, model_dir, device: str = "cpu", kv_bytes: int = 1 << 30, max_batched_tokens: int = 8192,
                 max_running: int = 64, numerics: str | None = None, slab_bytes: int = DEFAULT_SLAB_BYTES,
                 prefix_cache_blocks: int = 256, *, dtype: str = "bf16", max_len: int = 65536,
                 graphs: bool = True, runtime=None, prefix_cache_bytes: int = 1 << 30):
        """device "cuda": the GPU runner, `dtype` bf16 (or float32, to check it against the reference),
        requests up to max_len positions, decode CUDA graphs unless graphs=False. numerics exact, faithful or
        fast (docs/numerics.md#modes), on either device; by default faithful for checkpoints stored in fp8/fp4.
        prefix_cache_blocks (cpu) or prefix_cache_bytes (cuda) bound the prefix cache; 0 turns it off.
        max_batched_tokens: the tokens of one step, decode rows and prefill chunks together; one request's
        chunk may take all of it."""
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got '{device}'")
        self.device = device
        self.tokenizer = load_tokenizer(model_dir)
        self.max_len = max_len
        if device == "cuda":
            from ..cuda.driver import gpu_visible
            if not gpu_visible():
                raise ValueError("device 'cuda' was asked for, but no NVIDIA GPU is visible")
            from .gpu_runner import GpuRunner
            self.runner = GpuRunner.build(model_dir, dtype, kv_bytes, max_running, max_batched_tokens, max_len, graphs,
                                          runtime, numerics, slab_bytes)
            self.cfg, blocks = self.runner.model.cfg, self.runner.model.blocks
            capacity, size = prefix_cache_bytes, lambda snapshot: snapshot.nbytes
        else:
            self.model = load_model(model_dir, numerics)
            self.cfg = self.model.cfg
            # On the CPU the pages hold nothing, but they make admission and preemption real.
            plan = build_plan(self.cfg, numerics)
            blocks = BlockManager(plan, SlabAllocator(kv_bytes, plan.class_page_bytes, slab_bytes))
            self.runner = CpuRunner(self.model)
            capacity, size = prefix_cache_blocks, lambda snapshot: 1
        self.prefix = PrefixCache(capacity, size, self.runner.discard) if capacity else None
        self.scheduler = Scheduler(blocks, max_batched_tokens, max_running, self.prefix)
        self._live: dict[Hashable, Request] = {}
        self._ids = itertools.count()
        self.lock = threading.RLock()
        self.loop = EngineLoop(self)
        # steps by (requests, mean position to 1024), for --stats: bounded however long the engine runs
        self.step_shapes: Counter[tuple[int, int]] = Counter()

    def new_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Request:
        """A checked request, not yet queued (any thread may call it)."""
        params = (params or SamplingParams()).check()
        ids = self.tokenizer.encode(prompt, add_special_tokens=False).ids if isinstance(prompt, str) else \
            [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.cfg.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        if len(ids) + params.max_new_tokens > self.max_len:
            raise ValueError(f"{len(ids)} prompt + {params.max_new_tokens} new tokens exceed the engine's "
                             f"max_len {self.max_len}")
        request = Request(next(self._ids), ids, params)
        self.scheduler.check(request)
        return request

    def enqueue(self, request: Request) -> None:
        """Queue a request from new_request."""
        with self.lock:
            self.scheduler.add(request)
            self._live[request.id] = request

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> int:
        request = self.new_request(prompt, params)
        self.enqueue(request)
        return request.id

    def abort(self, request_id: Hashable) -> bool:
        """Stop a live request and free its pages; False when none has that id."""
        with self.lock:
            if self.scheduler.abort(request_id) is None:
                return False
            self.runner.release(request_id)
            self._live.pop(request_id)
            return True

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def live_ids(self) -> list[Hashable]:
        with self.lock:
            return list(self._live)

    def bind_thread(self) -> None:
        """Make this engine's device current in the calling thread (the loop's steps run in their own)."""
        if self.device == "cuda":
            from ..cuda.driver import check, drv
            check(drv().cuCtxSetCurrent(self.runner.model.rt.device.context))

    def step(self) -> list[RequestOutput]:
        """One scheduled step; the outputs of the requests it finished."""
        with self.lock:
            return [self.output(r) for r in self._step()]

    def _step(self) -> list[Request]:
        """One scheduled step (the caller holds the lock); the requests it finished."""
        step = self.scheduler.schedule()
        if not step:
            if self._live:
                raise RuntimeError("the scheduler made no progress with requests pending")
            return []
        positions = 0
        for request, _ in step:
            positions += request.computed
            if request.resume is not None:
                self.runner.restore(request.id, request.resume)
                request.resume = None
        self.step_shapes[len(step), positions // len(step) // 1024 * 1024] += 1
        tokens = self.runner.run(step)
        now = time.perf_counter()          # the step's tokens all arrive now
        finished, prefix = [], self.prefix
        for (request, n), token in zip(step, tokens):
            request.computed += n
            if prefix is not None and request.computed % BLOCK_POSITIONS == 0:
                self._remember(request)
            if request.remaining:          # a prefill chunk short of the last token: nothing to sample
                continue
            request.token_times.append(now)
            if request.first_token_at is None:
                request.first_token_at = now
            if token != EOS:
                request.generated.append(token)
            if token == EOS or len(request.generated) >= request.params.max_new_tokens:
                self.scheduler.finish(request, "stop" if token == EOS else "length")
                self.runner.release(request.id)
                del self._live[request.id]
                finished.append(request)
        return finished

    def generate(self, prompts: str | Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run the prompts to completion, batched with whatever else the loop runs; outputs in the
        prompts' order. A bare string is one prompt."""
        if isinstance(prompts, str):
            prompts = [prompts]
        per_prompt = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} sampling params for {len(prompts)} prompts")
        streams = self.loop.submit_all(list(zip(prompts, per_prompt)))
        try:
            for s in streams:
                s.result()
        except BaseException:
            for s in streams:
                s.close()
            raise
        return [self.output(s.request) for s in streams]

    def warm_up(self) -> None:
        """One short greedy request, so that the kernels are loaded (and the one-row decode graph captured) before
        a first real request would wait for them."""
        self.generate([[2, 3, 4]], SamplingParams(temperature=0, max_new_tokens=4))

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Iterator[str]:
        """Text pieces of one completion as they are sampled; closing the iterator early aborts it."""
        tokens = self.loop.submit(prompt, params)
        decoder = StreamDecoder(self.tokenizer)
        try:
            for ids in tokens:
                piece = "".join(decoder.push(t) for t in ids)
                if piece:
                    yield piece
            tail = decoder.flush()
            if tail:
                yield tail
        finally:
            tokens.close()

    def _remember(self, request: Request) -> None:
        key = request.prefix_hashes(request.computed)[-1]
        if key not in self.prefix:
            snapshot = self.runner.snapshot(request.id)
            if snapshot is not None:
                self.prefix.insert(key, request.computed // BLOCK_POSITIONS, snapshot)

    def output(self, request: Request) -> RequestOutput:
        first = None if request.first_token_at is None else request.first_token_at - request.arrived
        return RequestOutput(request.id, list(request.prompt), list(request.generated),
                             self.tokenizer.decode(request.generated), request.finish_reason, first)
