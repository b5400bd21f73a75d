import json
from pathlib import Path

import pytest

from dsv4rt.chat import (ASSISTANT, BOS, END_THINK, EOS, THINK, USER, StreamDecoder, encode_messages,
                         encode_prompt_ids, load_tokenizer, tokenizer_json_path)
from dsv4rt.chat.encoding import MAX_EFFORT_TEXT, SPECIAL_TEXTS

SHARED_GOLDEN = Path(__file__).resolve().parents[2] / "shared" / "golden" / "chat"
FIXTURE_GOLDEN = Path(__file__).resolve().parent / "fixtures" / "chat"
GOLDEN_DIRS = [d for d in (SHARED_GOLDEN, FIXTURE_GOLDEN) if d.is_dir()]
CASES = {2: "thinking", 4: "chat"}

B, E, U, A = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.mark.parametrize("folder", GOLDEN_DIRS, ids=lambda d: d.parent.parent.name)
@pytest.mark.parametrize("case", CASES)
def test_golden_byte_for_byte(folder, case):
    messages = json.loads((folder / f"input_{case}.json").read_text(encoding="utf-8"))
    want = (folder / f"output_{case}.txt").read_bytes()
    assert encode_messages(messages, CASES[case]).encode() == want


def test_fixture_copy_matches_shared_golden():
    if not SHARED_GOLDEN.is_dir():
        pytest.skip("no ../shared checkout")
    for path in SHARED_GOLDEN.iterdir():
        assert (FIXTURE_GOLDEN / path.name).read_bytes() == path.read_bytes()


def test_generation_prompt_per_mode():
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo", "reasoning_content": "r"}, {"role": "user", "content": "q"}]
    assert encode_messages(msgs, "chat") == f"{B}sys{U}hi{A}</think>yo{E}{U}q{A}</think>"
    assert encode_messages(msgs, "thinking") == f"{B}sys{U}hi{A}</think>yo{E}{U}q{A}<think>"
    assert encode_messages(msgs, "thinking", add_bos=False).startswith("sys")
    assert encode_messages(msgs, "thinking", drop_thinking=False) == f"{B}sys{U}hi{A}<think>r</think>yo{E}{U}q{A}<think>"


def test_special_texts_are_single_ids(tok):
    for text in SPECIAL_TEXTS:
        assert len(tok.encode(text, add_special_tokens=False).ids) == 1, text
    ids = {t: tok.token_to_id(t) for t in (B, E, U, A, "<think>", "</think>")}
    assert list(ids.values()) == [BOS, EOS, USER, ASSISTANT, THINK, END_THINK]


def test_prompt_ids(tok):
    msgs = [{"role": "user", "content": "Hello"}]
    chat = encode_prompt_ids(tok, msgs, "chat")
    assert chat[0] == BOS and chat[1] == USER and chat[-2:] == [ASSISTANT, END_THINK]
    assert encode_prompt_ids(tok, msgs, "thinking")[-2:] == [ASSISTANT, THINK]
    assert tok.decode(chat, skip_special_tokens=False) == encode_messages(msgs, "chat")


def test_tool_calls_and_results_in_call_order():
    calls = [{"id": "a", "type": "function", "function": {"name": "get", "arguments": '{"city": "Paris", "days": 2}'}},
             {"id": "b", "type": "function", "function": {"name": "time", "arguments": "{}"}}]
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "b", "content": "noon"},
            {"role": "tool", "tool_call_id": "a", "content": "sunny"},
            {"role": "user", "content": "thanks"}]
    d = "｜DSML｜"
    block = (f'\n\n<{d}tool_calls>\n<{d}invoke name="get">\n<{d}parameter name="city" string="true">Paris</{d}parameter>'
             f'\n<{d}parameter name="days" string="false">2</{d}parameter>\n</{d}invoke>\n'
             f'<{d}invoke name="time">\n\n</{d}invoke>\n</{d}tool_calls>')
    want = (f"{B}S{U}weather?{A}</think>{block}{E}"
            f"{U}<tool_result>sunny</tool_result>\n\n<tool_result>noon</tool_result>\n\nthanks{A}</think>")
    assert encode_messages(msgs, "chat") == want


def test_tool_definitions_keep_reasoning():
    tools = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "a1", "reasoning_content": "r1"}, {"role": "user", "content": "q2"}]
    text = encode_messages(msgs, "thinking", tools=tools)
    assert text.startswith(f"{B}S\n\n## Tools\n\nYou have access")
    assert '\n\n### Available Tool Schemas\n\n{"name": "get", "parameters": {"type": "object"}}\n\n' in text
    assert text.endswith(f"parameter schemas to invoke tool calls.\n{U}q1{A}<think>r1</think>a1{E}{U}q2{A}<think>")
    with pytest.raises(ValueError, match="system or developer"):
        encode_messages(msgs[1:], "chat", tools=tools)


def test_developer_reminder_task_and_effort():
    msgs = [{"role": "developer", "content": "D"}, {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}]
    assert encode_messages(msgs, "chat") == f"{B}{U}D{U}u1{A}</think>a1{E}{U}u2{A}</think>"
    assert encode_messages(msgs, "thinking") == f"{B}{U}u1{A}</think>a1{E}{U}u2{A}<think>"
    assert encode_messages(msgs, "thinking", reasoning_effort="max").startswith(B + MAX_EFFORT_TEXT + U)
    assert encode_messages(msgs, "chat", reasoning_effort="max").startswith(B + U)
    titled = [{"role": "user", "content": "name this", "task": "title"}, {"role": "assistant", "content": "T"}]
    assert encode_messages(titled, "thinking") == f"{B}{U}name this<｜title｜>T{E}"
    acted = [{"role": "user", "content": "x", "task": "action"}]
    assert encode_messages(acted, "thinking") == f"{B}{U}x{A}<think><｜action｜>"


@pytest.mark.parametrize("bad", [
    dict(messages=[{"role": "robot", "content": "x"}]),
    dict(messages=[{"role": "user", "content": "x"}], thinking_mode="deep"),
    dict(messages=[{"role": "user", "content": "x", "task": "dance"}]),
    dict(messages=[{"role": "developer", "content": ""}]),
])
def test_invalid_input_raises_value_error(bad):
    with pytest.raises(ValueError):
        encode_messages(**bad)


def test_stream_decoder_never_splits_characters(tok):
    text = "你好，世界！🌍🎉 naïve 😀👍🏽 𠮷野家 end"
    ids = tok.encode(text, add_special_tokens=False).ids
    dec = StreamDecoder(tok)
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert "" in pieces[:-1], "the sample should split some character across tokens"
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids) == text


def test_stream_decoder_skips_special_tokens(tok):
    ids = [BOS, *tok.encode("hi 🌍", add_special_tokens=False).ids, THINK, EOS]
    for skip in (True, False):
        dec = StreamDecoder(tok, skip_special=skip)
        out = "".join(dec.push(i) for i in ids) + dec.flush()
        assert out == tok.decode(ids, skip_special_tokens=skip)
    assert out == f"{B}hi 🌍<think>{E}"
    dec = StreamDecoder(tok)
    assert [dec.push(BOS), dec.push(EOS)] == ["", ""]


def test_tokenizer_paths(tmp_path):
    assert tokenizer_json_path(tmp_path).name == "tokenizer.json"
    (tmp_path / "tokenizer.json").write_text("{not json")
    assert tokenizer_json_path(tmp_path) == tmp_path / "tokenizer.json"
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
