"""`dsv4rt template render|parse`: the chat prompt the server feeds, and the message it reads back."""
from __future__ import annotations

import json
from pathlib import Path

import click

from . import main
from ..chat.dsml import parse_completion, render_prompt

_FILE_KEYS = ("messages", "tools", "tool_choice")


@main.group("template")
def template_cmd():
    """Render chat prompts and parse completions the way the server does."""


@template_cmd.command("render")
@click.argument("messages_file", metavar="MESSAGES.json")
@click.option("--thinking", is_flag=True, help="thinking mode (the prompt ends with <think>)")
@click.option("--reasoning-effort", type=click.Choice(["high", "max"]), help="max adds the Think-Max instruction")
def render_cmd(messages_file, thinking, reasoning_effort):
    """Print the prompt for MESSAGES.json (a list of messages, or an object with `messages` and optional `tools`
    and `tool_choice`) exactly as the official encoder writes it, without a trailing newline."""
    data = _read_json(messages_file)
    if isinstance(data, dict):
        unknown = sorted(set(data) - set(_FILE_KEYS))
        if unknown or "messages" not in data:
            raise ValueError(f"{messages_file}: expected keys messages, tools, tool_choice"
                             f"{'; unknown: ' + ', '.join(unknown) if unknown else '; messages is missing'}")
        messages, tools, tool_choice = data["messages"], data.get("tools"), data.get("tool_choice")
    else:
        messages, tools, tool_choice = data, None, None
    try:
        prompt = render_prompt(messages, tools, tool_choice, thinking=thinking, reasoning_effort=reasoning_effort)
    except ValueError as e:
        raise ValueError(f"{messages_file}: {e}") from None
    click.echo(prompt.encode("utf-8"), nl=False)  # bytes: no newline translation, no terminal encoding


@template_cmd.command("parse")
@click.argument("completion_file", metavar="COMPLETION.txt")
@click.option("--thinking", is_flag=True, help="the completion starts inside the reasoning")
def parse_cmd(completion_file, thinking):
    """Print the assistant message in COMPLETION.txt as JSON: content, reasoning_content, tool_calls."""
    message = parse_completion(_read_text(completion_file), thinking)
    click.echo(json.dumps(message, ensure_ascii=False, indent=2))


def _read_text(path):
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{path}: {'not a regular file' if file.exists() else 'no such file'}")
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror or e}") from None


def _read_json(path):
    try:
        return json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
