"""The engine in a process of its own, so that the HTTP front's Python (detokenizing, parsing DSML, writing
SSE for every token) never holds the GIL that the engine's steps need.

`dsv4rt serve` runs two processes:
- the front: uvicorn, the Server, the tokenizer and an `EngineProcess`; it never loads the model or CUDA;
- the engine process (multiprocessing "spawn": no fork of a process with threads and, on the GPU, a
  driver), which builds the Engine, warms it up and says "ready", or sends the one line of why it could not.
One duplex pipe joins them, pickled tuples both ways. Front to engine: ("submit", key, prompt ids,
SamplingParams), ("abort", key), ("abort_all",), ("stop",). Engine to front: ("ready", info) or
("failed", line) once; ("accepted", key, waiting) or ("rejected", key, the engine's ValueError), in the
order of the submits; and after every step one ("step", news, gauges): every stream's new ids and end as
(key, ids, end), end None, a finish reason or an EngineError, with the /metrics gauges.
In the engine process the main thread reads the pipe and submits (a refusal is immediate) and the
EngineLoop's thread steps and sends; in the front one thread reads the pipe and hands each message to the
event loop in one call_soon_threadsafe.
The engine process ignores SIGINT and SIGTERM (a terminal's Ctrl-C, or systemd's stop, reaches the whole
group: the front decides, drains, then says "stop") and ends on "stop" or when the pipe closes (the front
died), never left holding the GPU. When it dies the front sees the pipe close: every stream ends with an
EngineError, `failure` says why and `on_exit` runs (serve then drains and exits 1).
"""
from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import signal
import threading
from typing import Callable, Sequence

from ..chat import load_tokenizer
from ..cli.common import one_line, resolve_device
from ..engine import Engine
from ..engine.loop import EngineLoop
from ..reference.sampling import SamplingParams
from .backend import Backend, EngineError, Stream
from .metrics import engine_gauges


class EngineProcess(Backend):
    """The front's side: starts the engine process and waits until it is ready (a RuntimeError with its
    one line when it cannot start)."""

    def __init__(self, model_dir, device: str, **engine_options):
        tokenizer = load_tokenizer(model_dir)
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_engine_main, args=(child, str(model_dir), device, engine_options),
                                   name="dsv4rt-engine")
        self.process.start()
        child.close()                # the front's copy: the pipe closes when the engine process ends
        try:
            kind, info = self._conn.recv()
        except EOFError:
            self.process.join()
            raise RuntimeError(f"the engine process exited while starting (exit code {self.process.exitcode})") \
                from None
        except BaseException:        # Ctrl-C or SIGTERM while it starts
            self.process.kill()
            self.process.join()
            raise
        if kind == "failed":
            self.process.join()
            raise RuntimeError(info)
        super().__init__(tokenizer, info["max_len"])
        self.device, self._gauges = info["device"], info["gauges"]
        self._keys = itertools.count()
        self._accepting: dict[int, asyncio.Future] = {}        # submits not yet answered
        self._send_lock, self._stopping = threading.Lock(), False
        self.on_exit: Callable[[], None] | None = None         # called (from a thread) if the engine process dies
        threading.Thread(target=self._read, name="dsv4rt-engine-pipe", daemon=True).start()

    async def submit(self, ids: Sequence[int], params: SamplingParams) -> Stream:
        self._aloop = asyncio.get_running_loop()
        if self.failure:
            raise EngineError(self.failure)
        key = next(self._keys)
        accepted = self._accepting[key] = self._aloop.create_future()
        stream = self._streams[key] = Stream(key, self._abort)
        self._send(("submit", key, ids, params))
        await accepted
        return stream

    @property
    def waiting(self) -> int:
        return self._gauges["requests_waiting"] + len(self._accepting)

    @property
    def gauges(self) -> dict[str, float]:
        return {**self._gauges, "requests_waiting": self.waiting}

    def abort_all(self) -> None:
        self._send(("abort_all",))

    def close(self) -> None:
        """Stop the engine process and wait for it."""
        self._stopping = True
        self._send(("stop",))
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    def _abort(self, key) -> None:
        self._send(("abort", key))

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            try:
                self._conn.send(message)
            except OSError:          # the engine process is gone: _read tells
                pass

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            self._post(self._on_message, message)
        if self._stopping:
            return
        self.process.join(5)
        self.failure = f"the engine process exited unexpectedly (exit code {self.process.exitcode})"
        self._post(self._fail_all, EngineError(self.failure))
        if self.on_exit is not None:
            self.on_exit()

    def _on_message(self, message: tuple) -> None:
        kind, *rest = message
        if kind == "step":
            news, self._gauges = rest
            self._deliver(news)
            return
        key, value = rest
        accepted = self._accepting.pop(key)
        if kind == "accepted":
            self._gauges["requests_waiting"] = value
            if not accepted.done():
                accepted.set_result(None)
        else:
            del self._streams[key]
            if not accepted.done():
                accepted.set_exception(ValueError(value))

    def _fail_all(self, error: EngineError) -> None:
        for accepted in self._accepting.values():
            if not accepted.done():
                accepted.set_exception(error)
        for stream in self._streams.values():
            stream._give([], error)
        self._accepting.clear()
        self._streams.clear()


def _engine_main(conn, model_dir: str, device: str, options: dict) -> None:
    """The engine process."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    try:
        device = resolve_device(device)
        engine = Engine(model_dir, device, **options)
        engine.warm_up()
    except Exception as e:           # noqa: BLE001 - the front prints it as the command's one line
        conn.send(("failed", one_line(e)))
        return
    _Worker(engine, conn).serve(device)


class _Worker:
    def __init__(self, engine: Engine, conn):
        self.engine, self.conn = engine, conn
        # one message at a time on the pipe, and a request's key known before its news are sent
        self.lock = threading.Lock()
        self.keys: dict[int, object] = {}        # the front's key by request id
        self.ids: dict[object, int] = {}         # and back
        self.loop = EngineLoop(engine, self._publish)

    def serve(self, device: str) -> None:
        self._send(("ready", {"device": device, "max_len": self.engine.max_len, "gauges": self._gauges()}))
        handlers = {"submit": self._submit, "abort": self._abort, "abort_all": self.loop.abort_all}
        while True:
            try:
                kind, *args = self.conn.recv()
            except (EOFError, OSError):          # the front is gone
                return
            if kind == "stop":
                return
            handlers[kind](*args)

    def _gauges(self) -> dict[str, float]:
        return engine_gauges(self.engine, self.loop.waiting)

    def _send(self, message: tuple) -> None:
        try:
            self.conn.send(message)
        except OSError:                          # the front is gone: serve() sees the pipe close and returns
            pass

    def _submit(self, key, ids: list[int], params: SamplingParams) -> None:
        with self.lock:
            try:
                request_id = self.loop.submit(ids, params).id
            except ValueError as e:
                self._send(("rejected", key, str(e)))
                return
            self.keys[request_id], self.ids[key] = key, request_id
            self._send(("accepted", key, self.loop.waiting))

    def _abort(self, key) -> None:
        request_id = self.ids.get(key)
        if request_id is not None:
            self.loop.abort(request_id)

    def _publish(self, news: list) -> None:
        with self.lock:
            sent = []
            for request_id, ids, end in news:
                key = self.keys[request_id]
                if end is not None:
                    del self.keys[request_id], self.ids[key]
                if isinstance(end, BaseException):
                    end = EngineError(str(end) or type(end).__name__)
                sent.append((key, ids, end))
            self._send(("step", sent, self._gauges()))
