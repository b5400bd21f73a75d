"""DeepSeek V4 chat encoding: messages -> prompt text, following the official `encoding_dsv4.py` rules."""
import json

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


def encode_messages(messages, thinking_mode="chat", add_bos=True, drop_thinking=True, reasoning_effort=None,
                    tools=None) -> str:
    """Render a message list as the V4 prompt; a trailing user turn gets the generation prompt.

    `tools` (OpenAI function list) attaches to the leading system/developer message, as the official test cases do.
    `reasoning_effort="max"` adds the Think-Max instruction in thinking mode.
    """
    if thinking_mode not in ("chat", "thinking"):
        raise ValueError(f"thinking_mode must be 'chat' or 'thinking', not {thinking_mode!r}")
    if reasoning_effort not in (None, "high", "max"):
        raise ValueError(f"reasoning_effort must be None, 'high' or 'max', not {reasoning_effort!r}")
    thinking = thinking_mode == "thinking"
    msgs = _order_tool_results(_merge_tool_messages(messages))
    if tools:
        if not msgs or msgs[0].get("role") not in ("system", "developer"):
            raise ValueError("tool definitions need a system or developer message first")
        msgs[0]["tools"] = tools
    # Tool use relies on earlier reasoning, so the official encoder keeps it whenever tools are defined.
    keep_reasoning = not drop_thinking or any(m.get("tools") for m in msgs)
    if thinking and not keep_reasoning:
        msgs = _drop_before_last_user(msgs)
    last_user = max((i for i, m in enumerate(msgs) if m.get("role") in ("user", "developer")), default=-1)
    out = [BOS_TEXT] if add_bos else []
    if thinking and reasoning_effort == "max" and msgs:
        out.append(MAX_EFFORT_TEXT)
    for i in range(len(msgs)):
        out.append(_body(i, msgs, thinking, keep_reasoning, last_user))
        out.append(_transition(i, msgs, thinking, keep_reasoning, last_user))
    return "".join(out)


def encode_prompt_ids(tokenizer, messages, thinking_mode="chat", **kwargs) -> list:
    """Token ids of the prompt; the special-token strings in the text map to their single ids."""
    return tokenizer.encode(encode_messages(messages, thinking_mode, **kwargs), add_special_tokens=False).ids


def _body(i, msgs, thinking, keep_reasoning, last_user):
    msg = msgs[i]
    role, content = msg.get("role"), msg.get("content")
    if role == "system":
        return (content or "") + _extras(msg)
    if role == "developer":
        if not content:
            raise ValueError("a developer message needs content")
        return USER_TEXT + content + _extras(msg)
    if role == "user":
        blocks = msg.get("content_blocks")
        return USER_TEXT + ("\n\n".join(_block_text(b) for b in blocks) if blocks else content or "")
    if role == "latest_reminder":
        return REMINDER_TEXT + (content or "")
    if role == "assistant":
        reasoning = ""
        # The answer to a quick-instruction task never carries a reasoning block.
        after_task = i > 0 and msgs[i - 1].get("task") is not None
        if thinking and not after_task and (keep_reasoning or i > last_user):
            reasoning = (msg.get("reasoning_content") or "") + END_THINK_TEXT
        calls = _tool_calls_text(msg.get("tool_calls"))
        return reasoning + (content or "") + calls + ("" if msg.get("wo_eos") else EOS_TEXT)
    raise ValueError(f"unknown message role {role!r}")


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


def _extras(msg):
    text = ""
    if msg.get("tools"):
        schemas = "\n".join(_to_json(t["function"]) for t in msg["tools"])
        text += "\n\n" + _TOOLS_TEXT.replace("{schemas}", schemas)
    if msg.get("response_format"):
        text += "\n\n" + _RESPONSE_FORMAT_TEXT + _to_json(msg["response_format"])
    return text


def _block_text(block):
    kind = block.get("type")
    if kind == "text":
        return block.get("text", "")
    if kind != "tool_result":
        return f"[Unsupported {kind}]"
    result = block.get("content", "")
    if isinstance(result, list):
        result = "\n\n".join(b.get("text", "") if b.get("type") == "text" else f"[Unsupported {b.get('type')}]"
                             for b in result)
    return f"<tool_result>{result}</tool_result>"


def _tool_calls_text(tool_calls):
    if not tool_calls:
        return ""
    invokes = []
    for call in tool_calls:
        fn = call["function"]
        params = "\n".join(
            f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
            f"{v if isinstance(v, str) else _to_json(v)}</{DSML}parameter>"
            for k, v in _arguments(fn["arguments"]).items())
        invokes.append(f'<{DSML}invoke name="{fn["name"]}">\n{params}\n</{DSML}invoke>')
    return f"\n\n<{DSML}tool_calls>\n" + "\n".join(invokes) + f"\n</{DSML}tool_calls>"


def _arguments(raw):
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
