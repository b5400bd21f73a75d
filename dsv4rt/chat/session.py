"""A conversation over the Engine: history, prompt encoding, streamed replies.

Every turn is one Engine request for the whole history (the prefix cache spares recomputing it), so a
chat samples exactly what the Engine does for the same prompt and seed. A reply stopped early
(Ctrl-C) is kept in the history as far as it got; its request is aborted, so the next turn starts
from the recorded history alone, as a fresh run of it would. A turn that fails leaves the history as
it was before the turn."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterator

from ..reference.sampling import SamplingParams
from .detok import StreamDecoder
from .encoding import encode_prompt_ids
from .tokenizer import END_THINK


@dataclass
class Reply:
    reasoning: str = ""
    content: str = ""
    tokens: int = 0
    finish_reason: str | None = None


@dataclass
class ChatSession:
    engine: object                  # dsv4rt.engine.Engine
    params: SamplingParams = field(default_factory=SamplingParams)
    thinking: bool = False
    system: str | None = None
    messages: list = field(default_factory=list)

    def clear(self):
        self.messages = []

    def prompt_ids(self, messages: list | None = None) -> list[int]:
        msgs = ([{"role": "system", "content": self.system}] if self.system else []) + \
            (self.messages if messages is None else messages)
        return encode_prompt_ids(self.engine.tokenizer, msgs, "thinking" if self.thinking else "chat")

    def turn_request(self, text: str) -> tuple[list[int], SamplingParams]:
        """The prompt ids and sampling settings of the answer to `text`; ValueError when the prompt leaves
        no room in the context. The reply is cut to the positions left."""
        ids = self.prompt_ids(self.messages + [{"role": "user", "content": text}])
        room = self.engine.max_len - len(ids)
        if room < 1:
            raise ValueError(f"the message is too long: the prompt would be {len(ids)} tokens and the context "
                             f"holds {self.engine.max_len}; /clear forgets the conversation")
        params = replace(self.params, max_new_tokens=min(self.params.max_new_tokens, room))
        return ids, params

    def reply(self, text: str, out: Reply) -> Iterator[str]:
        """Stream the answer to `text` piece by piece; `out` collects it. Stopping the iteration early
        records what was produced so far; an error records nothing."""
        ids, params = self.turn_request(text)
        stream = self.engine.loop.submit(ids, params)
        decoder = StreamDecoder(self.engine.tokenizer)
        in_reasoning = self.thinking
        try:
            for tokens in stream:
                for token in tokens:
                    out.tokens += 1
                    if token == END_THINK and in_reasoning:
                        in_reasoning = False
                        out.reasoning += decoder.flush()
                        yield "\n\n"
                        continue
                    piece = decoder.push(token)
                    if in_reasoning:
                        out.reasoning += piece
                    else:
                        out.content += piece
                    yield piece
            tail = decoder.flush()
            out.content += tail
            yield tail
        finally:
            stream.close()
            out.finish_reason = stream.finish_reason
            if out.finish_reason != "error":     # stopped early ("abort"): what came is kept
                self._record(text, out)

    def _record(self, text: str, out: Reply) -> None:
        msg = {"role": "assistant", "content": out.content}
        if out.reasoning:
            msg["reasoning_content"] = out.reasoning
        self.messages += [{"role": "user", "content": text}, msg]
