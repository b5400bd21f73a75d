"""A conversation over one model: history, prompt encoding, streamed generation."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from ..reference.sampling import SamplingParams, sample
from .detok import StreamDecoder
from .encoding import encode_prompt_ids
from .tokenizer import END_THINK, EOS


class Generator:
    """Keeps one request's state and the ids it has consumed, so a follow-up prompt that extends
    them only feeds the new tokens."""

    def __init__(self, model):
        self.model = model
        self.reset()

    def reset(self):
        self.state = self.model.new_state()
        self.fed: list[int] = []

    def prefill(self, ids: list[int]) -> np.ndarray:
        if ids[:len(self.fed)] != self.fed or len(ids) == len(self.fed):
            self.reset()
        new = ids[len(self.fed):]
        logits = self._last_logits(np.array(new))
        self.fed += new
        return logits

    def step(self, token: int) -> np.ndarray:
        self.fed.append(token)
        return self._last_logits(np.array([token]))

    def _last_logits(self, ids: np.ndarray) -> np.ndarray:
        return self.model.forward(self.state, ids)[-1]


class GpuGenerator(Generator):
    """The same over the GPU model's request slot 0 (dsv4rt.model.forward.GpuModel)."""

    def reset(self):
        self.model.reset()
        self.fed = []

    def _last_logits(self, ids: np.ndarray) -> np.ndarray:
        return self.model.forward(ids, last_only=True)[-1]


@dataclass
class Reply:
    reasoning: str = ""
    content: str = ""
    tokens: int = 0


@dataclass
class ChatSession:
    generator: Generator
    tokenizer: object
    params: SamplingParams = field(default_factory=SamplingParams)
    thinking: bool = False
    system: str | None = None
    messages: list = field(default_factory=list)

    def __post_init__(self):
        self.reseed()

    def reseed(self):
        self.rng = np.random.default_rng(self.params.seed)

    def clear(self):
        self.messages = []
        self.generator.reset()

    def prompt_ids(self) -> list[int]:
        msgs = ([{"role": "system", "content": self.system}] if self.system else []) + self.messages
        return encode_prompt_ids(self.tokenizer, msgs, "thinking" if self.thinking else "chat")

    def reply(self, text: str, out: Reply) -> Iterator[str]:
        """Stream the answer to `text` piece by piece; `out` collects it. Stopping the iteration
        early (Ctrl-C) still records what was produced so far."""
        self.messages.append({"role": "user", "content": text})
        decoder = StreamDecoder(self.tokenizer)
        in_reasoning = self.thinking
        try:
            logits = self.generator.prefill(self.prompt_ids())
            for _ in range(self.params.max_new_tokens):
                token = sample(logits, self.params, self.rng)
                if token == EOS:
                    break
                out.tokens += 1
                if token == END_THINK and in_reasoning:
                    in_reasoning = False
                    out.reasoning += decoder.flush()
                    yield "\n\n"
                else:
                    piece = decoder.push(token)
                    if in_reasoning:
                        out.reasoning += piece
                    else:
                        out.content += piece
                    yield piece
                logits = self.generator.step(token)
            tail = decoder.flush()
            out.content += tail
            yield tail
        finally:
            msg = {"role": "assistant", "content": out.content}
            if out.reasoning:
                msg["reasoning_content"] = out.reasoning
            self.messages.append(msg)
