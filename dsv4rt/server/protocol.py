"""OpenAI request bodies checked and turned into engine work: prompt ids, sampling settings, stop
strings, thinking and tools. Every bad field is an APIError naming it."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..chat import dsml
from ..reference.sampling import SamplingParams


class APIError(Exception):
    """An OpenAI-shaped error response."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


@dataclass
class Job:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    stop: list[str] = field(default_factory=list)
    thinking: bool = False
    tools: bool = False            # whether the completion is parsed for DSML tool calls


def _bad(param: str, rule: str) -> APIError:
    return APIError(400, f"{param} must be {rule}", param)


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v > high or \
            (v <= low if low_open else v < low):
        raise _bad(name, f"a number in {'(' if low_open else '['}{low}, {high}]")
    return float(v)


def _integer(body: dict, name: str, low: int, high: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise _bad(name, f"an integer from {low} to {high}")
    return v


def _flag(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(name, "true or false")
    return v


def check_model(body: dict, served: str) -> None:
    model = body.get("model")
    if model is not None and model != served:
        raise APIError(404, f"the model '{model}' does not exist; this server serves '{served}'", "model",
                       "model_not_found")


def _common(body: dict, max_len: int, prompt_len: int, what: str) -> tuple[SamplingParams, list[str], bool, bool]:
    if _integer(body, "n", 1, 1 << 30) not in (None, 1):
        raise APIError(400, "n must be 1: one choice per request", "n")
    for name in ("logprobs", "top_logprobs", "echo", "suffix"):
        if body.get(name) not in (None, False, 0, ""):
            raise APIError(400, f"{name} is not supported", name)
    if prompt_len >= max_len:
        raise APIError(400, f"the {what} is {prompt_len} tokens and the model's context is {max_len}: "
                            f"nothing is left to generate", what, "context_length_exceeded")
    room = max_len - prompt_len
    max_tokens = _integer(body, "max_completion_tokens", 1, 1 << 40)
    name = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, name = _integer(body, "max_tokens", 1, 1 << 40), "max_tokens"
    if max_tokens is not None and max_tokens > room:
        raise APIError(400, f"{name} is {max_tokens}, but the {what} ({prompt_len} tokens) leaves {room} of the "
                            f"model's context of {max_len}", name, "context_length_exceeded")
    top_k = _integer(body, "top_k", -1, 1 << 30)
    params = SamplingParams(temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                            top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
                            top_k=0 if top_k in (None, -1) else top_k,
                            max_new_tokens=max_tokens or room,
                            seed=_integer(body, "seed", 0, (1 << 63) - 1))
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise _bad("stop", "a non-empty string or a list of them")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("stream_options", "an object")
    include_usage = _flag(options or {}, "include_usage")
    return params, stop, _flag(body, "stream"), include_usage


def _thinking(body: dict) -> tuple[bool, str | None]:
    """chat_template_kwargs {"thinking", "reasoning_effort"}, or DeepSeek's own `thinking` field
    (true/false or {"type": "enabled"|"disabled"}) and `reasoning_effort`."""
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise _bad("chat_template_kwargs", "an object")
    thinking = kwargs.get("thinking", kwargs.get("enable_thinking", body.get("thinking", False)))
    if isinstance(thinking, dict):
        if thinking.get("type") not in ("enabled", "disabled"):
            raise _bad("thinking", 'true, false or {"type": "enabled" | "disabled"}')
        thinking = thinking["type"] == "enabled"
    if not isinstance(thinking, bool):
        raise _bad("thinking", 'true, false or {"type": "enabled" | "disabled"}')
    effort = kwargs.get("reasoning_effort", body.get("reasoning_effort"))
    if effort not in (None, "high", "max"):
        raise _bad("reasoning_effort", '"high" or "max"')
    return thinking, effort


def chat_job(body: dict, tokenizer, max_len: int) -> Job:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "a non-empty list of messages")
    thinking, effort = _thinking(body)
    tools, choice = body.get("tools"), body.get("tool_choice")
    try:
        ids = dsml.prompt_ids(tokenizer, messages, tools, choice, thinking, effort)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        param = next((p for p in ("tool_choice", "tools") if text.startswith(p)), "messages")
        raise APIError(400, f"bad {param}: {text}", param) from None
    params, stop, stream, usage = _common(body, max_len, len(ids), "messages")
    return Job(ids, params, stream, usage, stop, thinking, bool(tools) and choice != "none")


def completion_job(body: dict, tokenizer, max_len: int) -> Job:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = prompt
        vocab = tokenizer.get_vocab_size()
        if min(ids) < 0 or max(ids) >= vocab:
            raise APIError(400, f"prompt token ids must lie in [0, {vocab})", "prompt")
    else:
        raise _bad("prompt", "a non-empty string or list of token ids (one prompt)")
    params, stop, stream, usage = _common(body, max_len, len(ids), "prompt")
    return Job(list(ids), params, stream, usage, stop)
