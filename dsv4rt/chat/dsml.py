"""OpenAI-shaped chat around DeepSeek V4: prompts with tools, and completions parsed back, streaming or whole
(docs/formats.md#tool-calls).

The model writes its reasoning, then `</think>`, then its answer, then tool calls as one DSML block:
    \\n\\n<｜DSML｜tool_calls>\\n<｜DSML｜invoke name="NAME">\\n
    <｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>\\n ... </｜DSML｜invoke>\\n
    </｜DSML｜tool_calls>
The parser follows the official `parse_message_from_completion_text` on well-formed text and differs where it
would raise: a block before `</think>` ends the reasoning, a malformed or unfinished block and the text after it
come back as content, a `string="false"` value that is not JSON is kept as a string.
"""
import json
import uuid

from .encoding import DSML, END_THINK_TEXT, EOS_TEXT, encode_messages, encode_prompt_ids

TOOL_CALLS_OPEN = f"<{DSML}tool_calls>"
TOOL_CALLS_CLOSE = f"</{DSML}tool_calls>"
INVOKE_OPEN = f'<{DSML}invoke name="'
INVOKE_CLOSE = f"</{DSML}invoke>"
PARAM_OPEN = f'<{DSML}parameter name="'
PARAM_CLOSE = f"</{DSML}parameter>"
_WS = " \t\r\n"
_MAX_HEADER = 512    # a tool or parameter name longer than this is not one


def render_prompt(messages, tools=None, tool_choice=None, thinking=False, reasoning_effort=None) -> str:
    """The prompt text the official encoder produces (tool_choice "required"/named adds one sentence)."""
    return encode_messages(messages, "thinking" if thinking else "chat", reasoning_effort=reasoning_effort,
                           tools=tools, tool_choice=tool_choice)


def prompt_ids(tokenizer, messages, tools=None, tool_choice=None, thinking=False, reasoning_effort=None) -> list:
    """Token ids of `render_prompt`; marker strings typed in the client's text stay ordinary text."""
    return encode_prompt_ids(tokenizer, messages, "thinking" if thinking else "chat",
                             reasoning_effort=reasoning_effort, tools=tools, tool_choice=tool_choice)


def parse_completion(text, thinking) -> dict:
    """The assistant message in a completion's text: content, reasoning_content and OpenAI tool_calls."""
    parser = StreamParser(thinking)
    return fold(parser.feed(text) + parser.finish())


def fold(events) -> dict:
    """StreamParser's events as one message: content, reasoning_content and OpenAI tool_calls."""
    parts = {"content": [], "reasoning_content": [], "tool_calls": []}
    for event in events:
        if "tool_call" in event:
            parts["tool_calls"].append(openai_call(event["tool_call"]))
        else:
            (kind, piece), = event.items()
            parts[kind].append(piece)
    return {"content": "".join(parts["content"]), "reasoning_content": "".join(parts["reasoning_content"]),
            "tool_calls": parts["tool_calls"]}


def openai_call(call: dict) -> dict:
    """A parsed tool call (a `tool_call` event) as OpenAI's tool_calls entry."""
    return {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}


class StreamParser:
    """Completion text in, OpenAI-shaped deltas out, piece by piece; the result never depends on how the text
    is cut. Text that may start a marker is held back until it is decided, so no DSML reaches `content`
    unless the block turns out malformed."""

    def __init__(self, thinking: bool, tools: bool = True):
        self._tools = tools
        self._mode = "reasoning_content" if thinking else "content"
        self._origin = self._mode      # the mode a tool-call block interrupted
        self._buf = ""
        self._pos = 0                  # in a block: where the next invoke starts
        self._raw = 0                  # in a block: start of the text that is content if the block fails
        self._calls = 0
        self._searched = {}            # in a block: value start -> how far it is known to hold no marker
        self._ended = False

    def feed(self, text: str) -> list[dict]:
        if self._ended:
            return []
        seen = max(0, len(self._buf) - len(EOS_TEXT) + 1)
        self._buf += text
        end = self._buf.find(EOS_TEXT, seen)
        if end < 0:
            return self._advance(final=False)
        self._buf = self._buf[:end]
        return self.finish()

    def finish(self) -> list[dict]:
        if self._ended:
            return []
        self._ended = True
        return self._advance(final=True)

    def _advance(self, final):
        events = []
        while True:
            if self._mode == "tool_calls":
                if not self._step_block(events, final):
                    break
            elif not self._step_text(events, final):
                break
        return _merged(events)

    def _stops(self):
        stops = []                     # no eos: feed cut the text at it (_held_back still holds its start)
        if self._mode == "reasoning_content":
            stops.append(END_THINK_TEXT)
        if self._tools:
            stops.append(TOOL_CALLS_OPEN)
        return stops

    def _step_text(self, events, final):
        """Emit reasoning or content up to the next marker; False when waiting for more text."""
        buf, stops = self._buf, self._stops()
        found = min(((buf.find(s), s) for s in stops if s in buf), default=None)
        if found is None:
            hold = 0 if final else _held_back(buf, stops, self._tools)
            _emit(events, self._mode, buf[:len(buf) - hold])
            self._buf = buf[len(buf) - hold:]
            return False
        at, stop = found
        if stop == END_THINK_TEXT:
            _emit(events, self._mode, buf[:at])
            self._buf, self._mode = buf[at + len(stop):], "content"
            return True
        # The official format puts "\n\n" before the block; it belongs to the block, not to the text.
        newlines = min(2, at - len(buf[:at].rstrip("\n")))
        _emit(events, self._mode, buf[:at - newlines])
        self._buf, self._origin, self._mode = buf[at - newlines:], self._mode, "tool_calls"
        self._raw, self._pos = 0, newlines + len(stop)
        return True

    def _step_block(self, events, final):
        """Emit the next finished tool call, close or give up on the block; False when waiting for more text."""
        kind, *rest = _next_in_block(self._buf, self._pos, self._searched)
        if kind != "more":
            self._searched.clear()
        if kind == "call":
            name, arguments, self._pos = rest
            self._raw = self._pos
            events.append({"tool_call": {"index": self._calls, "id": f"call_{uuid.uuid4().hex[:24]}",
                                         "name": name, "arguments": arguments}})
            self._calls += 1
            return True
        if kind == "close":
            self._buf, self._mode = self._buf[rest[0]:], self._origin
            return True
        if kind == "more" and not final:
            return False
        # A malformed or unfinished block, and all that follows it, is content; the whitespace after the last
        # finished call of a cut-off block (max_tokens) is nothing.
        bad_at = rest[0] if kind == "bad" else len(self._buf)
        raw = self._buf[self._raw:bad_at]
        if kind == "bad" or raw.strip(_WS):
            _emit(events, "content", raw)
        self._buf, self._mode = self._buf[bad_at:], "content"
        return True


def _next_in_block(buf, pos, searched):
    """("call", name, arguments, end) | ("close", end) | ("more",) | ("bad", where) for the block text at pos.
    `searched` remembers how far each value was scanned, so a long value streamed in is not rescanned."""
    i = _skip_ws(buf, pos)
    if buf.startswith(TOOL_CALLS_CLOSE, i):
        return "close", i + len(TOOL_CALLS_CLOSE)
    if not buf.startswith(INVOKE_OPEN, i):
        return ("more",) if _could_be(buf[i:], TOOL_CALLS_CLOSE, INVOKE_OPEN) else ("bad", i)
    header = _header(buf, i + len(INVOKE_OPEN), 1)
    if header[0] != "ok":
        return header if header[0] == "more" else ("bad", i)
    _, (name,), j = header
    params = {}
    while True:
        j = _skip_ws(buf, j)
        if buf.startswith(INVOKE_CLOSE, j):
            body = ", ".join(f"{_json(k)}: {v}" for k, v in params.items())
            return "call", name, "{" + body + "}", j + len(INVOKE_CLOSE)
        if not buf.startswith(PARAM_OPEN, j):
            return ("more",) if _could_be(buf[j:], INVOKE_CLOSE, PARAM_OPEN) else ("bad", i)
        header = _header(buf, j + len(PARAM_OPEN), 2)
        if header[0] != "ok":
            return header if header[0] == "more" else ("bad", i)
        _, (key, string), start = header
        end = buf.find(PARAM_CLOSE, searched.get(start, start))
        if end < 0:
            stray = buf.find(DSML, searched.get(start, start))
            unfinished = stray < 0 or (stray - 2 >= start and PARAM_CLOSE.startswith(buf[stray - 2:]))
            if unfinished:
                searched[start] = max(start, len(buf) - len(PARAM_CLOSE))
            return ("more",) if unfinished else ("bad", i)
        value = buf[start:end]
        if DSML in value or key in params:
            return "bad", i
        params[key] = _json(value) if string == "true" or not _is_json(value) else value
        j = end + len(PARAM_CLOSE)


def _header(buf, start, fields):
    """Read `NAME">` (fields=1) or `NAME" string="true|false">` (fields=2) from start."""
    close = buf.find(">", start, start + _MAX_HEADER + 1)
    if close < 0:
        rest = buf[start:start + _MAX_HEADER + 1]
        return ("bad",) if "\n" in rest or DSML in rest or len(rest) > _MAX_HEADER else ("more",)
    text = buf[start:close]
    if fields == 1:
        name, quote = text[:-1], text[-1:]
        ok = quote == '"' and name and '"' not in name
        return ("ok", (name,), close + 1) if ok and "\n" not in name and DSML not in name else ("bad",)
    name, sep, flag = text.partition('" string="')
    ok = sep and name and '"' not in name and "\n" not in name and DSML not in name
    return ("ok", (name, flag[:-1]), close + 1) if ok and flag in ('true"', 'false"') else ("bad",)


def _held_back(buf, stops, tools):
    """How many trailing characters could still become a marker or the eos (and, with tools, the newlines
    before one)."""
    hold = max((n for s in (*stops, EOS_TEXT) for n in range(1, min(len(s), len(buf) + 1)) if buf.endswith(s[:n])),
               default=0)
    if tools:
        rest = buf[:len(buf) - hold]
        hold += min(2, len(rest) - len(rest.rstrip("\n")))
    return hold


def _could_be(rest, *expected):
    """Whether `rest` may still grow into one of `expected` (or into the eos that cuts the block short)."""
    return any(e.startswith(rest) for e in (*expected, EOS_TEXT))


def _skip_ws(buf, i):
    while i < len(buf) and buf[i] in _WS:
        i += 1
    return i


def _is_json(text):
    try:
        json.loads(text, parse_constant=_reject)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the json module follows
        return False
    return True


def _reject(name):
    raise ValueError(f"{name} is not JSON")


def _json(value):
    return json.dumps(value, ensure_ascii=False)


def _emit(events, kind, text):
    if text:
        events.append({kind: text})


def _merged(events):
    """Adjacent text deltas of one kind joined, so a feed returns as few events as it can."""
    out = []
    for event in events:
        if out and "tool_call" not in event and event.keys() == out[-1].keys():
            (kind, text), = event.items()
            out[-1] = {kind: out[-1][kind] + text}
        else:
            out.append(event)
    return out
