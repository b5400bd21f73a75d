"""DeepSeek V4 chat encoding: messages -> prompt text, following the official `encoding_dsv4.py` rules
(docs/formats.md#chat-format)."""
import json

from .tokenizer import encode_plain, marker_pattern

BOS_TEXT = "<｜begin▁of▁sentence｜>"
EOS_TEXT = "<｜end▁of▁sentence｜>"
USER_TEXT = "<｜User｜>"
ASSISTANT_TEXT = "<｜Assistant｜>"
REMINDER_TEXT = "<｜latest_reminder｜>"
THINK_TEXT = "<think>"
END_THINK_TEXT = "</think>"
DSML = "｜DSML｜"
TASK_TEXTS = {name: f"<｜{name}｜>" for name in ("action", "query", "authority", "domain", "title", "read_url")}
SPECIAL_TEXTS = (BOS_TEXT, EOS_TEXT, USER_TEXT, ASSISTANT_TEXT, REMINDER_TEXT, THINK_TEXT, END_THINK_TEXT, DSML,
                 *TASK_TEXTS.values())

MAX_EFFORT_TEXT = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause,"
    " rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered"
    " alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)

_TOOLS_TEXT = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{DSML}tool_calls>" block like the following:

<{DSML}tool_calls>
<{DSML}invoke name="$TOOL_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$TOOL_NAME2">
...
</{DSML}invoke>
</{DSML}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_TEXT}), you MUST output your complete reasoning inside {THINK_TEXT}...{END_THINK_TEXT} BEFORE any tool calls or final response.

Otherwise, output directly after {END_THINK_TEXT} with tool calls or final response.

### Available Tool Schemas

{{schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

_RESPONSE_FORMAT_TEXT = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"


_TOOL_CHOICE_TEXT = "\nYou MUST call {what} in this response.\n"


class Typed(str):
    """Text the client wrote: marker strings inside it are ordinary text, never control tokens."""

    __slots__ = ()


def encode_messages(messages, thinking_mode="chat", add_bos=True, drop_thinking=True, reasoning_effort=None,
                    tools=None, tool_choice=None) -> str:
    """Render a message list as the V4 prompt; a trailing user turn gets the generation prompt.

    `tools` (OpenAI function list) attaches to the first system/developer message (an empty system message is put
    first when there is none), as the official test cases do. `tool_choice` "none" leaves the tools out; "required"
    and a named function add one sentence after the tool schemas (the official encoder has no tool_choice).
    `reasoning_effort="max"` adds the Think-Max instruction in thinking mode.
    """
    return "".join(render_pieces(messages, thinking_mode, add_bos, drop_thinking, reasoning_effort, tools, tool_choice))


def encode_prompt_ids(tokenizer, messages, thinking_mode="chat", **kwargs) -> list:
    """Token ids of the prompt: marker strings are control tokens in the template's own text, plain text in the
    client's (a user typing `<｜Assistant｜>` must not open an assistant turn)."""
    markers = marker_pattern(tokenizer)
    ids, run = [], []

    def flush():
        text = "".join(run)
        run.clear()
        if text:
            ids.extend(encode_plain(tokenizer, text))

    for piece in render_pieces(messages, thinking_mode, **kwargs):
        if isinstance(piece, Typed):
            run.append(piece)
            continue
        start = 0
        for found in markers.finditer(piece):
            run.append(piece[start:found.start()])
            flush()
            ids.append(tokenizer.token_to_id(found.group()))
            start = found.end()
        run.append(piece[start:])
    flush()
    return ids


def render_pieces(messages, thinking_mode="chat", add_bos=True, drop_thinking=True, reasoning_effort=None,
                  tools=None, tool_choice=None) -> list:
    """The prompt as a list of strings: `Typed` ones are the client's text, plain ones the template's."""
    if thinking_mode not in ("chat", "thinking"):
        raise ValueError(f"thinking_mode must be 'chat' or 'thinking', not {thinking_mode!r}")
    if reasoning_effort not in (None, "high", "max"):
        raise ValueError(f"reasoning_effort must be None, 'high' or 'max', not {reasoning_effort!r}")
    _check_messages(messages)
    thinking = thinking_mode == "thinking"
    msgs = _order_tool_results(_merge_tool_messages(messages))
    tools, must_call = _chosen_tools(tools, tool_choice)
    host = None
    if tools:
        host = next((m for m in msgs if m.get("role") in ("system", "developer")), None)
        if host is None:
            host = {"role": "system", "content": ""}
            msgs.insert(0, host)
        host["tools"] = tools
    # Tool use relies on earlier reasoning, so the official encoder keeps it whenever tools are defined.
    keep_reasoning = not drop_thinking or any(m.get("tools") for m in msgs)
    if thinking and not keep_reasoning:
        msgs = _drop_before_last_user(msgs)
    last_user = max((i for i, m in enumerate(msgs) if m.get("role") in ("user", "developer")), default=-1)
    out = [BOS_TEXT] if add_bos else []
    if thinking and reasoning_effort == "max" and msgs:
        out.append(MAX_EFFORT_TEXT)
    for i in range(len(msgs)):
        # Only the host message gets the tool_choice sentence (a client's message keys never become template text).
        out += _body(i, msgs, thinking, keep_reasoning, last_user, must_call if msgs[i] is host else None)
        out.append(_transition(i, msgs, thinking, keep_reasoning, last_user))
    return out


_ROLES = ("system", "user", "assistant", "tool", "developer", "latest_reminder")


def _check_messages(messages):
    """The shapes the renderer relies on; a client's JSON can hold anything (contents are checked in `_text`)."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ValueError("messages must be a list of objects")
    for n, msg in enumerate(messages):
        if msg.get("role") not in _ROLES:
            raise ValueError(f"unknown message role {msg.get('role')!r}")
        for key in ("task", "tool_call_id"):
            if not isinstance(msg.get(key, ""), (str, type(None))):
                raise ValueError(f"messages[{n}].{key} must be a string")
        calls = msg.get("tool_calls") or []
        if not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("id", ""), (str, type(None)))
                and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str) for c in calls):
            raise ValueError(f'messages[{n}].tool_calls must be a list of {{"id": ..., "function": {{"name": ...}}}}')
        if msg.get("tools"):
            _check_tools(msg["tools"])


def _check_tools(tools):
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            for t in tools):
        raise ValueError('tools must be a list of {"type": "function", "function": {"name": ...}} objects')


def _chosen_tools(tools, tool_choice):
    """(tools to show, sentence demanding a call or None) for OpenAI `tools` and `tool_choice`."""
    if tools is None:
        tools = []
    _check_tools(tools)
    if tool_choice in (None, "auto"):
        return tools, None
    if tool_choice == "none":
        return [], None
    if not tools:
        raise ValueError(f"tool_choice {tool_choice!r} needs tools")
    if tool_choice == "required":
        return tools, _TOOL_CHOICE_TEXT.format(what="at least one of the above tools")
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ValueError('tool_choice must be "auto", "none", "required" or {"type": "function", '
                         '"function": {"name": ...}}')
    chosen = [t for t in tools if t["function"]["name"] == name]
    if not chosen:
        raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
    return chosen, _TOOL_CHOICE_TEXT.format(what=f'the tool "{name}"')


def _text(value, what):
    """Message text: a string, null, or a list of OpenAI text parts (joined by newlines)."""
    if value is None:
        return Typed("")
    if isinstance(value, str):
        return Typed(value)
    if isinstance(value, list):
        parts = []
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"{what} part of type {kind!r} is not supported (text only)")
            parts.append(part["text"])
        return Typed("\n".join(parts))
    raise ValueError(f"{what} must be a string or a list of text parts, not {type(value).__name__}")


def _body(i, msgs, thinking, keep_reasoning, last_user, must_call=None):
    msg = msgs[i]
    role = msg.get("role")
    content = _text(msg.get("content"), f"{role} content")
    if role == "system":
        return [content, *_extras(msg, must_call)]
    if role == "developer":
        if not content:
            raise ValueError("a developer message needs content")
        return [USER_TEXT, content, *_extras(msg, must_call)]
    if role == "user":
        blocks = msg.get("content_blocks")
        if not blocks:
            return [USER_TEXT, content]
        out = [USER_TEXT]
        for n, block in enumerate(blocks):
            out += (["\n\n"] if n else []) + _block_pieces(block)
        return out
    if role == "latest_reminder":
        return [REMINDER_TEXT, content]
    # assistant (roles were checked up front, tool turns merged into user ones)
    reasoning = []
    # The answer to a quick-instruction task never carries a reasoning block.
    after_task = i > 0 and msgs[i - 1].get("task") is not None
    if thinking and not after_task and (keep_reasoning or i > last_user):
        reasoning = [_text(msg.get("reasoning_content"), "reasoning_content"), END_THINK_TEXT]
    return [*reasoning, content, *_tool_calls_pieces(msg.get("tool_calls")), "" if msg.get("wo_eos") else EOS_TEXT]


def _transition(i, msgs, thinking, keep_reasoning, last_user):
    """What follows a message when the model speaks next (next is assistant/latest_reminder, or end of list)."""
    if i + 1 < len(msgs) and msgs[i + 1].get("role") not in ("assistant", "latest_reminder"):
        return ""
    msg = msgs[i]
    task = msg.get("task")
    if task is not None:
        if task not in TASK_TEXTS:
            raise ValueError(f"unknown task {task!r}; known: {', '.join(TASK_TEXTS)}")
        if task != "action":
            return TASK_TEXTS[task]
        return ASSISTANT_TEXT + (THINK_TEXT if thinking else END_THINK_TEXT) + TASK_TEXTS[task]
    if msg.get("role") in ("user", "developer"):
        opens = thinking and (keep_reasoning or i >= last_user)
        return ASSISTANT_TEXT + (THINK_TEXT if opens else END_THINK_TEXT)
    return ""


def _extras(msg, must_call=None):
    out = []
    if msg.get("tools"):
        head, tail = _TOOLS_TEXT.split("{schemas}")
        out += ["\n\n" + head, Typed("\n".join(_to_json(t["function"]) for t in msg["tools"])), tail]
        if must_call:
            out.append(must_call)
    if msg.get("response_format"):
        out += ["\n\n" + _RESPONSE_FORMAT_TEXT, Typed(_to_json(msg["response_format"]))]
    return out


def _block_pieces(block):
    kind = block.get("type")
    if kind == "text":
        return [_text(block.get("text"), "user content")]
    if kind != "tool_result":
        return [Typed(f"[Unsupported {kind}]")]
    result = block.get("content")
    if isinstance(result, list):
        result = "\n\n".join(b.get("text", "") if b.get("type") == "text" else f"[Unsupported {b.get('type')}]"
                             for b in result if isinstance(b, dict))
    return ["<tool_result>", _text(result, "tool content"), "</tool_result>"]


def _tool_calls_pieces(tool_calls):
    if not tool_calls:
        return []
    out = [f"\n\n<{DSML}tool_calls>\n"]
    for n, call in enumerate(tool_calls):
        fn = call["function"]
        out += (["\n"] if n else []) + [f'<{DSML}invoke name="', Typed(fn["name"]), '">\n']
        for k, (key, value) in enumerate(_arguments(fn.get("arguments")).items()):
            string = isinstance(value, str)
            out += (["\n"] if k else []) + [f'<{DSML}parameter name="', Typed(key),
                                            f'" string="{"true" if string else "false"}">',
                                            Typed(value if string else _to_json(value)), f"</{DSML}parameter>"]
        out.append(f"\n</{DSML}invoke>")
    out.append(f"\n</{DSML}tool_calls>")
    return out


def _arguments(raw):
    """The official encoder's reading of `arguments`: a JSON object string, anything else is one "arguments" value."""
    try:
        parsed = json.loads(raw)
    except (TypeError, ValueError):
        parsed = None
    return parsed if isinstance(parsed, dict) else {"arguments": raw}


def _to_json(value):
    return json.dumps(value, ensure_ascii=False)


def _merge_tool_messages(messages):
    """V4 has no tool role: tool results and consecutive user texts join one user turn as blocks (a task ends it)."""
    merged = []
    for msg in messages:
        role = msg.get("role")
        prev = merged[-1] if merged else {}
        mergeable = prev.get("role") == "user" and "content_blocks" in prev
        if role == "tool":
            block = {"type": "tool_result", "tool_use_id": msg.get("tool_call_id", ""), "content": msg.get("content", "")}
            if mergeable:
                prev["content_blocks"].append(block)
            else:
                merged.append({"role": "user", "content_blocks": [block]})
        elif role == "user":
            block = {"type": "text", "text": msg.get("content") or ""}
            if mergeable and prev.get("task") is None:
                prev["content_blocks"].append(block)
            else:
                kept = {k: msg[k] for k in ("task", "wo_eos", "mask") if k in msg}
                merged.append({"role": "user", "content": block["text"], "content_blocks": [block], **kept})
        else:
            merged.append(dict(msg))
    return merged


def _order_tool_results(msgs):
    """Tool results go in the order of the calls that asked for them (by tool_call_id)."""
    order = {}
    for msg in msgs:
        if msg.get("role") == "assistant" and msg.get("tool_calls"):
            order = {}
            for n, call in enumerate(msg["tool_calls"]):
                call_id = call.get("id") or call.get("function", {}).get("id", "")
                if call_id:
                    order[call_id] = n
        elif msg.get("role") == "user" and msg.get("content_blocks"):
            results = [b for b in msg["content_blocks"] if b.get("type") == "tool_result"]
            if len(results) > 1 and order:
                ranked = iter(sorted(results, key=lambda b: order.get(b.get("tool_use_id", ""), 0)))
                msg["content_blocks"] = [next(ranked) if b.get("type") == "tool_result" else b
                                         for b in msg["content_blocks"]]
    return msgs


def _drop_before_last_user(msgs):
    """Thinking mode forgets developer turns before the last user turn (earlier reasoning is dropped in `_body`)."""
    last_user = max((i for i, m in enumerate(msgs) if m.get("role") in ("user", "developer")), default=-1)
    kept_roles = ("user", "system", "latest_reminder", "assistant")
    return [m for i, m in enumerate(msgs) if i >= last_user or m.get("role") in kept_roles]
