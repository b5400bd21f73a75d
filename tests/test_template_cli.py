import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from dsv4rt.cli import main

GOLDEN = Path(__file__).resolve().parent / "fixtures" / "chat"
D, E = "｜DSML｜", "<｜end▁of▁sentence｜>"


def run(*args):
    return CliRunner().invoke(main, ["template", *map(str, args)])


@pytest.mark.parametrize("case, flags", [(2, ["--thinking"]), (4, [])])
def test_render_golden_byte_for_byte(case, flags):
    result = run("render", GOLDEN / f"input_{case}.json", *flags)
    assert result.exit_code == 0, result.output
    assert result.stdout_bytes == (GOLDEN / f"output_{case}.txt").read_bytes()


def test_render_object_with_tools_and_effort(tmp_path):
    tools = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}]
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"messages": messages, "tools": tools}))
    result = run("render", path, "--thinking", "--reasoning-effort", "max")
    assert result.exit_code == 0, result.output
    text = result.stdout_bytes.decode()
    assert text.startswith("<｜begin▁of▁sentence｜>Reasoning Effort: Absolute maximum")
    assert '\n\n### Available Tool Schemas\n\n{"name": "get", "parameters": {"type": "object"}}\n\n' in text
    assert text.endswith("to invoke tool calls.\n<｜User｜>q<｜Assistant｜><think>")
    path.write_text(json.dumps({"messages": messages, "tools": tools, "tool_choice": "none"}))
    without = run("render", path).stdout_bytes.decode()
    assert without == "<｜begin▁of▁sentence｜>S<｜User｜>q<｜Assistant｜></think>"


def test_parse_prints_the_assistant_message(tmp_path):
    path = tmp_path / "c.txt"
    call = (f'\n\n<{D}tool_calls>\n<{D}invoke name="get">\n<{D}parameter name="n" string="false">{{"a": [1]}}'
            f'</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>{E}')
    path.write_text(f"Why not.</think>Sure.{call}", encoding="utf-8")
    result = run("parse", path, "--thinking")
    assert result.exit_code == 0, result.output
    message = json.loads(result.stdout)
    (tool_call,) = message.pop("tool_calls")
    assert message == {"content": "Sure.", "reasoning_content": "Why not."}
    assert tool_call["type"] == "function" and tool_call["id"].startswith("call_")
    assert tool_call["function"] == {"name": "get", "arguments": '{"n": {"a": [1]}}'}
    path.write_text(f"Plain <{D}tool_calls> answer.{E}", encoding="utf-8")
    assert json.loads(run("parse", path).stdout) == {"content": f"Plain <{D}tool_calls> answer.",
                                                     "reasoning_content": "", "tool_calls": []}


@pytest.mark.parametrize("content, message", [
    (None, "error: {path}: no such file"),
    (b"\xff\xfe", "error: {path}: not UTF-8 text (byte 0)"),
    (b"[{", "error: {path}: not valid JSON: Expecting property name enclosed in double quotes: "
            "line 1 column 3 (char 2)"),
    (b'{"msgs": []}', "error: {path}: expected keys messages, tools, tool_choice; unknown: msgs"),
    (b'{"tools": []}', "error: {path}: expected keys messages, tools, tool_choice; messages is missing"),
    (b'"hello"', "error: {path}: messages must be a list of objects"),
    (b'[{"role": "robot", "content": "x"}]', "error: {path}: unknown message role 'robot'"),
    (b'{"messages": [], "tools": [{"function": {"name": "f"}}], "tool_choice": 3}',
     'error: {path}: tool_choice must be "auto", "none", "required" or '
     '{"type": "function", "function": {"name": ...}}'),
])
def test_render_bad_input_is_one_line(tmp_path, content, message):
    path = tmp_path / "m.json"
    if content is not None:
        path.write_bytes(content)
    result = run("render", path)
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [message.replace("{path}", str(path))]
    assert result.stdout == ""


def test_parse_bad_input_is_one_line(tmp_path):
    result = run("parse", tmp_path)
    assert (result.exit_code, result.stderr) == (1, f"error: {tmp_path}: not a regular file\n")
    (tmp_path / "c.txt").write_bytes(b"ok \xc3")
    result = run("parse", tmp_path / "c.txt")
    assert (result.exit_code, result.stderr) == (1, f"error: {tmp_path / 'c.txt'}: not UTF-8 text (byte 3)\n")
    result = CliRunner().invoke(main, ["template", "render", "x.json", "--reasoning-effort", "low"])
    assert result.exit_code == 2
    assert result.stderr == "error: Invalid value for '--reasoning-effort': 'low' is not one of 'high', 'max'.\n"
