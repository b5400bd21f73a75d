"""What the Server needs of an engine, and that engine in this process.

A backend has the tokenizer, `max_len`, `async submit(ids, params) -> Stream` (ValueError: the engine
refused the request), `waiting`, the /metrics `gauges`, `abort_all()` and `failure` (why the engine is gone;
None while it serves). Each engine step's news, for every stream at once, reaches the event loop in one
call_soon_threadsafe (from an EngineLoop's sink, dsv4rt/engine/loop.py, or from the thread that reads the
engine process's pipe) and `_deliver` hands it to the streams there, so the Server reads a Stream the same
way whichever backend feeds it:
- `EngineProcess` (process.py): the engine in a child process, what `dsv4rt serve` runs;
- `LocalEngine`: an Engine in this process, for tests (its loop thread and the event loop share the GIL).
"""
from __future__ import annotations

import asyncio
from typing import Sequence

from ..engine.loop import EngineLoop
from ..reference.sampling import SamplingParams
from .metrics import engine_gauges


class EngineError(RuntimeError):
    """What ended a stream on the engine's side (a step that raised, an engine process that died)."""


class Stream:
    """One request's token ids as they reach the event loop, a list a step: `async for ids in stream`;
    `finish_reason` when it ends ("stop", "length", "abort", or "error" when it raised)."""

    def __init__(self, key, abort):
        self.key, self.finish_reason = key, None
        self._abort, self._items = abort, asyncio.Queue()

    def _give(self, ids: list[int], end) -> None:
        self._items.put_nowait((ids, end))

    async def __aiter__(self):
        try:
            while True:
                ids, end = await self._items.get()
                if ids:
                    yield ids
                if isinstance(end, BaseException):
                    self.finish_reason = "error"
                    raise end
                if end is not None:
                    self.finish_reason = end
                    return
        finally:
            if self.finish_reason is None:
                self.cancel()

    def cancel(self) -> None:
        """Ask the engine to abort the request (a client that left); never blocks."""
        if self.finish_reason is None:
            self.finish_reason = "abort"
            self._abort(self.key)


class Backend:
    failure: str | None = None

    def __init__(self, tokenizer, max_len: int):
        self.tokenizer, self.max_len = tokenizer, max_len
        self._streams: dict[object, Stream] = {}
        self._aloop: asyncio.AbstractEventLoop | None = None   # the server's, known from the first submit

    def _post(self, handler, *args) -> None:
        """Run handler(*args) in the event loop (from another thread)."""
        if self._aloop is not None:
            try:
                self._aloop.call_soon_threadsafe(handler, *args)
            except RuntimeError:         # the event loop has closed: the server is done
                pass

    def _deliver(self, news: list[tuple[object, list[int], object]]) -> None:
        for key, ids, end in news:
            self._streams[key]._give(ids, end)
            if end is not None:
                del self._streams[key]


class LocalEngine(Backend):
    """An Engine in this process, stepped by a loop of its own."""

    def __init__(self, engine):
        super().__init__(engine.tokenizer, engine.max_len)
        self.engine = engine
        self.loop = EngineLoop(engine, self._publish)

    def _publish(self, news: list) -> None:
        if news:
            self._post(self._deliver, news)

    async def submit(self, ids: Sequence[int], params: SamplingParams) -> Stream:
        self._aloop = asyncio.get_running_loop()
        key = self.loop.submit(ids, params).id
        # its news reach _deliver through the event loop, which runs nothing else until this returns
        stream = self._streams[key] = Stream(key, self.loop.abort)
        return stream

    @property
    def waiting(self) -> int:
        return self.loop.waiting

    @property
    def gauges(self) -> dict[str, float]:
        return engine_gauges(self.engine, self.loop.waiting)

    def abort_all(self) -> None:
        self.loop.abort_all()
