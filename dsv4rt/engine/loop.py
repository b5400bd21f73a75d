"""The engine loop: one thread runs the Engine's steps; any number of threads and asyncio tasks submit
requests to it and stream their tokens back.

The concurrency model:
- `EngineLoop.submit` checks and tokenizes the request in the caller's thread (a bad request raises
  there, before anything is queued), puts it in the loop's inbox and returns its `TokenStream` at once.
- The loop thread alone takes requests in, aborts them and steps the engine. It runs while there is
  work and ends when there is none; the next submit starts a new one. Between two steps it takes in
  the inbox and the aborts, so a submit or an abort waits for at most the step that is running.
- After each step every stream receives its request's new token ids, then its finish reason
  ("stop", "length" or "abort"). A thread reads a stream as a blocking iterator; an asyncio task with
  `async for` (the items reach its event loop through call_soon_threadsafe, which never blocks it).
- Leaving a stream early aborts its request: `close()` (threads) returns once the pages are free,
  `cancel()` (asyncio, a client that disconnected) only asks the loop, which frees them between steps.
- An exception in a step aborts every live request and ends each stream with that exception, raised
  in its reader; the loop serves on. `abort_all()` (a server past its grace period) ends them alike,
  with "abort".
- A loop given a `sink` hands each step's news to it in one list instead of to the streams (the server's
  backends: dsv4rt/server/backend.py): every stream with news as (request id, new token ids, end), end
  being None while its request runs, then the finish reason or the exception that ended it.
The Engine's own methods (step, add_request, abort) take its lock, so calling them directly from
other threads while the loop runs is safe too.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from ..reference.sampling import SamplingParams
from .request import Request

if TYPE_CHECKING:
    from .engine import Engine


class TokenStream:
    """The token ids of one request as the loop samples them, in lists (one per step); `finish_reason`
    is set when the iteration ends."""

    def __init__(self, loop: "EngineLoop", request: Request, aloop: asyncio.AbstractEventLoop | None):
        self.request, self.finish_reason = request, None
        self._loop, self._aloop = loop, aloop
        self._items = asyncio.Queue() if aloop is not None else queue.SimpleQueue()
        self.sent = 0                      # tokens handed to the reader (the loop thread's count)

    @property
    def id(self):
        return self.request.id

    def _put(self, item) -> None:
        if self._aloop is None:
            self._items.put(item)
        else:
            try:
                self._aloop.call_soon_threadsafe(self._items.put_nowait, item)
            except RuntimeError:           # the reader's event loop has closed: nobody is left to tell
                pass

    def _give(self, ids: list[int], end) -> None:
        if ids:
            self._put(("tokens", ids))
        if isinstance(end, BaseException):
            self._put(("error", end))
        elif end is not None:
            self._put(("end", end))

    def _take(self, item) -> list[int]:
        kind, value = item
        if kind == "error":
            self.finish_reason = "error"
            raise value
        if kind == "end":
            self.finish_reason = value
            raise StopIteration
        return value

    def __iter__(self) -> Iterator[list[int]]:
        try:
            while True:
                try:
                    yield self._take(self._items.get())
                except StopIteration:
                    return
        finally:
            if self.finish_reason is None:
                self.close()

    async def __aiter__(self):
        try:
            while True:
                try:
                    yield self._take(await self._items.get())
                except StopIteration:
                    return
        finally:
            if self.finish_reason is None:
                self.cancel()

    def result(self) -> list[int]:
        """Wait for the end; every token id."""
        return [t for ids in self for t in ids]

    def close(self) -> None:
        """Abort the request and wait until its pages are free (threads only: it blocks)."""
        if self.finish_reason is None:
            self.finish_reason = "abort"
            self._loop.abort(self.request.id, wait=True)

    def cancel(self) -> None:
        """Ask the loop to abort the request; never blocks."""
        if self.finish_reason is None:
            self.finish_reason = "abort"
            self._loop.abort(self.request.id, wait=False)


Sink = Callable[[list[tuple[object, list[int], object]]], None]


class EngineLoop:
    def __init__(self, engine: "Engine", sink: Sink | None = None):
        """`sink`, when given, takes every step's news in place of the streams; it runs in the loop's thread, or
        in the thread that calls abort_all."""
        self.engine, self.sink = engine, sink
        self._cond = threading.Condition()
        self._inbox: list[TokenStream] = []
        self._aborts: list[tuple[object, threading.Event | None]] = []
        self._streams: dict[object, TokenStream] = {}     # the loop thread's, by request id
        self._thread: threading.Thread | None = None
        self.steps = 0

    def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
               aloop: asyncio.AbstractEventLoop | None = None) -> TokenStream:
        """Queue one request; `aloop`: the event loop of the asyncio task that will read the stream."""
        return self.submit_all([(prompt, params)], aloop)[0]

    def submit_all(self, requests: Sequence[tuple[str | Sequence[int], SamplingParams | None]],
                   aloop: asyncio.AbstractEventLoop | None = None) -> list[TokenStream]:
        """Queue several requests together: all are checked before any is queued, and the loop takes
        them in at once (a batch is admitted as one, as far as the cache allows)."""
        streams = [TokenStream(self, self.engine.new_request(prompt, params), aloop) for prompt, params in requests]
        with self._cond:
            self._inbox += streams
            self._wake()
        return streams

    def abort(self, request_id, wait: bool = False) -> None:
        done = threading.Event() if wait else None
        with self._cond:
            self._aborts.append((request_id, done))
            self._wake()
        if done is not None:
            done.wait()

    @property
    def waiting(self) -> int:
        """Requests submitted and not yet running."""
        return len(self._inbox) + len(self.engine.scheduler.waiting)

    def _wake(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dsv4rt-engine", daemon=True)
            self._thread.start()
        self._cond.notify()

    def _run(self) -> None:
        try:
            self.engine.bind_thread()
            while self._turn():
                pass
        except BaseException as e:
            with self._cond:
                self._thread = None
                inbox, aborts = self._inbox, self._aborts
                self._inbox, self._aborts = [], []
            self._hand([(stream, [], e) for stream in inbox])
            for _, done in aborts:
                if done is not None:
                    done.set()
            self.abort_all(e)
            raise

    def _turn(self) -> bool:
        """Take in the inbox and the aborts, run one step, hand out its tokens; False when idle."""
        engine = self.engine
        with self._cond:
            inbox, aborts = self._inbox, self._aborts
            self._inbox, self._aborts = [], []
            if not inbox and not aborts and not engine.has_unfinished():
                self._thread = None             # the next submit starts another
                return False
        with engine.lock:
            for stream in inbox:
                engine.enqueue(stream.request)
                self._streams[stream.id] = stream
            for request_id, done in aborts:
                engine.abort(request_id)
                if done is not None:
                    done.set()
            if engine.has_unfinished():
                try:
                    engine._step()              # the outputs are the streams' to build: none here
                    self.steps += 1
                except Exception as e:          # noqa: BLE001 - handed to every reader; the loop goes on
                    self.abort_all(e)
            self._publish()
        return True

    def _publish(self, error: BaseException | None = None) -> None:
        """Hand out every stream's new tokens, and the end of those whose request is done (of all, with `error`)."""
        news = []
        for stream in self._streams.values():
            request = stream.request
            end = error if error is not None else request.finish_reason if request.done else None
            if len(request.generated) > stream.sent or end is not None:
                news.append((stream, request.generated[stream.sent:], end))
                stream.sent = len(request.generated)
        for stream, _, end in news:
            if end is not None:
                del self._streams[stream.id]
        self._hand(news)

    def _hand(self, news: list[tuple[TokenStream, list[int], object]]) -> None:
        if self.sink is not None:
            self.sink([(stream.id, ids, end) for stream, ids, end in news])
        else:
            for stream, ids, end in news:
                stream._give(ids, end)

    def abort_all(self, error: BaseException | None = None) -> None:
        """Abort every live request and end every stream: the tokens it has not had, then `error` (raised in its
        reader) or else "abort". Any thread may call it (it takes the engine's lock)."""
        with self.engine.lock:
            for request_id in self.engine.live_ids():
                self.engine.abort(request_id)
            self._publish(error)
