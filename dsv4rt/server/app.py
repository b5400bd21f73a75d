"""The OpenAI-compatible HTTP API over one engine, as a Starlette (ASGI) app.

Each request is checked and tokenized in the event loop, submitted to the engine through its backend
(backend.py: the engine process of `dsv4rt serve`, process.py, or an Engine in this process) and read
back with `async for`; a client that disconnects, streaming or not, aborts its request at once, so its
pages are free after the engine's next step. An engine that is gone makes /health and new requests 503."""
from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from ..chat import dsml
from .backend import EngineError
from .generation import Outcome, deltas
from .metrics import Metrics
from .protocol import APIError, Job, chat_job, check_model, completion_job

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


class EventStream(Response):
    """Server-sent events from an async iterator of bytes; `on_disconnect` runs the moment the client leaves."""

    media_type = "text/event-stream"

    def __init__(self, events, on_disconnect):
        self.events, self.on_disconnect = events, on_disconnect
        self.status_code, self.background = 200, None
        self.init_headers({"Cache-Control": "no-cache"})

    async def __call__(self, scope, receive, send):
        watcher = asyncio.ensure_future(_disconnected(receive, self.on_disconnect))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:                       # the client left while we wrote
            self.on_disconnect()
        finally:
            watcher.cancel()
            await self.events.aclose()


async def _disconnected(receive, then) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    then()


def _sse(data: dict | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode()


def _failed(e: Exception) -> APIError:
    return APIError(500, f"generation failed: {e or type(e).__name__}")


def _chat_delta(event: dict) -> dict:
    if "tool_call" in event:
        call = event["tool_call"]
        return {"tool_calls": [{"index": call["index"], **dsml.openai_call(call)}]}
    if "reasoning_content" in event:        # vLLM's clients read `reasoning`
        return {"reasoning_content": event["reasoning_content"], "reasoning": event["reasoning_content"]}
    return event


class Server:
    """The routes, over `engine`: a backend (backend.py)."""

    def __init__(self, engine, name: str, api_key: str | None = None, max_waiting: int = 256,
                 max_body_bytes: int = 32 << 20):
        self.engine, self.name, self.api_key = engine, name, api_key
        self.max_waiting, self.max_body_bytes = max_waiting, max_body_bytes
        self.metrics = Metrics()
        self.draining = False
        self.created = int(time.time())

    def app(self) -> Starlette:
        routes = [Route(CHAT, self.chat, methods=["POST"]), Route(COMPLETIONS, self.completions, methods=["POST"]),
                  Route("/v1/models", self.models), Route("/health", self.health), Route("/metrics", self.scrape)]
        return Starlette(routes=routes, exception_handlers={HTTPException: self._http_error})

    async def _http_error(self, request: Request, exc: HTTPException) -> JSONResponse:
        return self._error(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))

    def _error(self, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), e.status)

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise APIError(401, "a valid API key is required: Authorization: Bearer KEY", None, "invalid_api_key")

    async def _json(self, request: Request) -> dict:
        declared = request.headers.get("content-length", "")
        too_large = declared.isdigit() and int(declared) > self.max_body_bytes
        body, seen = bytearray(), 0
        async for chunk in request.stream():     # read to the end, so the client gets the answer, not a reset
            seen += len(chunk)
            if seen > self.max_body_bytes:
                too_large = True
            elif not too_large:
                body += chunk
            if seen > 16 * self.max_body_bytes:
                break
        if too_large:
            raise APIError(413, f"the request body is over {self.max_body_bytes} bytes")
        try:
            data = json.loads(body)
        except ValueError:
            raise APIError(400, "the request body is not valid JSON") from None
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object")
        return data

    async def models(self, request: Request) -> JSONResponse:
        try:
            self._authorize(request)
        except APIError as e:
            return self._error(e)
        model = {"id": self.name, "object": "model", "created": self.created, "owned_by": "dsv4rt",
                 "max_model_len": self.engine.max_len}
        return JSONResponse({"object": "list", "data": [model]})

    async def health(self, request: Request) -> Response:
        if self.engine.failure:
            return PlainTextResponse(f"{self.engine.failure}\n", 503)
        return PlainTextResponse("draining\n" if self.draining else "ok\n", 503 if self.draining else 200)

    async def scrape(self, request: Request) -> Response:
        return PlainTextResponse(self.metrics.render(self.engine.gauges),
                                 media_type="text/plain; version=0.0.4")

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, CHAT)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, COMPLETIONS)

    async def _generate(self, request: Request, endpoint: str) -> Response:
        try:
            if self.engine.failure:
                raise APIError(503, self.engine.failure)
            if self.draining:
                raise APIError(503, "the server is shutting down")
            self._authorize(request)
            body = await self._json(request)
            check_model(body, self.name)
            make_job = chat_job if endpoint == CHAT else completion_job
            job = make_job(body, self.engine.tokenizer, self.engine.max_len)
            if self.engine.waiting >= self.max_waiting:
                raise APIError(429, f"the queue is full ({self.max_waiting} requests waiting); retry later")
            try:
                stream = await self.engine.submit(job.prompt_ids, job.params)
            except ValueError as e:
                raise APIError(400, str(e), "prompt" if endpoint == COMPLETIONS else "messages") from None
            except EngineError as e:
                raise APIError(503, str(e)) from None
        except APIError as e:
            self.metrics.request(endpoint, e.status)
            return self._error(e)
        self.metrics.request(endpoint, 200)
        self.metrics.prompt_tokens += len(job.prompt_ids)
        chat = endpoint == CHAT
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        out = Outcome()
        events = deltas(job, stream, self.engine.tokenizer, chat, self.metrics, time.perf_counter(), out)
        if job.stream:
            return EventStream(self._chunks(rid, job, chat, events, out), stream.cancel)
        collect = asyncio.ensure_future(self._collect(rid, job, chat, events, out))
        gone = asyncio.ensure_future(_disconnected(request.receive, stream.cancel))
        try:
            await asyncio.wait([collect, gone], return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():               # the client left, or the server is stopping
                collect.cancel()
                stream.cancel()
        return collect.result() if not collect.cancelled() else Response(status_code=499)

    def _head(self, rid: str, chat: bool) -> dict:
        return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.name}

    def _usage(self, job: Job, out: Outcome) -> dict:
        return {"prompt_tokens": len(job.prompt_ids), "completion_tokens": out.completion_tokens,
                "total_tokens": len(job.prompt_ids) + out.completion_tokens}

    async def _chunks(self, rid: str, job: Job, chat: bool, events, out: Outcome):
        head = self._head(rid, chat)

        def chunk(delta: dict, finish: str | None = None) -> bytes:
            choice = {"index": 0, "delta": delta} if chat else {"index": 0, "text": delta.get("text", "")}
            return _sse({**head, "choices": [{**choice, "logprobs": None, "finish_reason": finish}]})
        try:
            if chat:
                yield chunk({"role": "assistant", "content": ""})
            async for batch in events:
                for event in batch:
                    yield chunk(_chat_delta(event) if chat else event)
            self.metrics.finished[out.finish_reason] += 1
            if out.finish_reason == "abort":
                return
            yield chunk({}, out.finish_reason)
            if job.include_usage:
                yield _sse({**head, "choices": [], "usage": self._usage(job, out)})
        except Exception as e:                   # noqa: BLE001 - the stream has begun: the error goes in it
            self.metrics.finished["error"] += 1
            yield _sse(_failed(e).body())
        yield _sse("[DONE]")

    async def _collect(self, rid: str, job: Job, chat: bool, events, out: Outcome) -> JSONResponse:
        try:
            got = [event async for batch in events for event in batch]
        except Exception as e:                   # noqa: BLE001 - one request failed, the server goes on
            self.metrics.finished["error"] += 1
            return self._error(_failed(e))
        self.metrics.finished[out.finish_reason] += 1
        body = {**self._head(rid, chat), "object": "chat.completion" if chat else "text_completion",
                "usage": self._usage(job, out)}
        if not chat:
            body["choices"] = [{"index": 0, "text": "".join(e["text"] for e in got), "logprobs": None,
                                "finish_reason": out.finish_reason}]
            return JSONResponse(body)
        folded = dsml.fold(got)
        content, calls = folded["content"], folded["tool_calls"]
        message = {"role": "assistant", "content": content if content or not calls else None}
        if job.thinking:
            message["reasoning_content"] = message["reasoning"] = folded["reasoning_content"]
        if calls:
            message["tool_calls"] = calls
        body["choices"] = [{"index": 0, "message": message, "logprobs": None, "finish_reason": out.finish_reason}]
        return JSONResponse(body)
