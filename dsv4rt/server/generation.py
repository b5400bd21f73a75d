"""One request's tokens as OpenAI deltas: text with stop strings cut, then reasoning, content and tool
calls from the DSML parser (dsv4rt/chat/dsml.py), the only place tools and reasoning enter."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AsyncIterator

from ..chat import dsml
from ..chat.detok import StreamDecoder
from .backend import Stream
from .metrics import Metrics
from .protocol import Job


class StopText:
    """Detokenized text with the stop strings cut: what could still begin one is held back."""

    def __init__(self, tokenizer, stops: list[str], skip_special: bool):
        self.decoder = StreamDecoder(tokenizer, skip_special)
        self.stops, self.held, self.stopped = stops, "", False

    def push(self, ids: list[int]) -> str:
        text = self.held + "".join(self.decoder.push(t) for t in ids)
        keep = max((n for s in self.stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        return self._cut(text, keep)

    def flush(self) -> str:
        return "" if self.stopped else self._cut(self.held + self.decoder.flush(), 0)

    def _cut(self, text: str, keep: int) -> str:
        """Text up to the first stop string (then stopped), else all but its last `keep` characters."""
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:
            self.stopped, self.held = True, ""
            return text[:min(found)]
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]


@dataclass
class Outcome:
    finish_reason: str | None = None
    completion_tokens: int = 0
    tool_calls: int = 0


async def deltas(job: Job, stream: Stream, tokenizer, chat: bool, metrics: Metrics, arrived: float,
                 out: Outcome) -> AsyncIterator[list[dict]]:
    """Yield lists of deltas ({"content"}, {"reasoning_content"}, {"tool_call"} for chat; {"text"} for
    completions) as tokens arrive; `out` holds the finish reason and counts at the end."""
    text = StopText(tokenizer, job.stop, skip_special=not chat)
    parser = dsml.StreamParser(job.thinking, job.tools) if chat else None
    last = arrived

    def shaped(piece: str, final: bool) -> list[dict]:
        if parser is None:
            return [{"text": piece}] if piece else []
        events = parser.feed(piece) + (parser.finish() if final else [])
        out.tool_calls += sum("tool_call" in e for e in events)
        return events

    async for ids in stream:
        now = time.perf_counter()
        metrics.tokens(now - last, len(ids), first=out.completion_tokens == 0)
        last = now
        out.completion_tokens += len(ids)
        events = shaped(text.push(ids), False)
        if events:
            yield events
        if text.stopped:
            stream.cancel()
            break
    events = shaped(text.flush(), True)
    if events:
        yield events
    reason = "stop" if text.stopped else stream.finish_reason
    out.finish_reason = "tool_calls" if out.tool_calls and reason == "stop" else reason
