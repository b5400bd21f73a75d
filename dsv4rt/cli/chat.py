"""`dsv4rt chat`: a terminal conversation with streamed tokens."""
from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import click

from . import main
from .common import DEVICES, max_batched_tokens_option, numerics_option, one_line, resolve_device
from ..reference.sampling import SamplingParams

HELP = """commands:
  /exit                 leave (Ctrl-D does the same)
  /clear                forget the conversation
  /system TEXT          set the system prompt (and clear)
  /set NAME VALUE       temperature, top_p, top_k, max_new_tokens or seed
  /help                 this text
Ctrl-C stops the current reply."""

CHAT_MAX_LEN = 1 << 16        # positions of one conversation: a longer prompt is refused
CHAT_KV_BYTES = 4 << 30
_SETTABLE = {"temperature": float, "top_p": float, "top_k": int, "max_new_tokens": int, "seed": int}


def demo_model_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dsv4rt" / "demo"


def _ensure_demo() -> Path:
    path = demo_model_dir()
    if not (path / "config.json").exists():
        from ..tiny import make_tiny
        click.echo(f"creating the demo model (random weights, V4 tokenizer) in {path}", err=True)
        try:
            make_tiny(path, "demo", seed=0)  # built in a temporary folder, renamed into place when complete
        except (ValueError, OSError):
            # another first-time chat renamed its copy into place first: the same seed, the same model
            if not (path / "config.json").exists():
                raise
    return path


def _say(session, text: str) -> bool:
    """Print the reply to `text`; False when the turn failed (its error is one line on stderr)."""
    from ..chat.session import Reply
    out = Reply()
    pieces = session.reply(text, out)
    try:
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
    except KeyboardInterrupt:
        pieces.close()
        sys.stdout.write(" [stopped]")
    except (ValueError, RuntimeError, OSError, MemoryError) as e:
        pieces.close()
        if out.tokens:
            sys.stdout.write("\n")
        sys.stdout.flush()
        click.echo(f"error: {one_line(e)}", err=True)
        return False
    sys.stdout.write("\n")
    sys.stdout.flush()
    return True


def _command(session, line: str) -> bool:
    """Handle a /command; False means leave."""
    name, _, arg = line[1:].partition(" ")
    arg = arg.strip()
    if name == "exit":
        return False
    if name == "clear":
        session.clear()
        click.echo("(conversation cleared)")
    elif name == "system":
        session.system = arg or None
        session.clear()
        click.echo("(system prompt set)" if arg else "(system prompt removed)")
    elif name == "set":
        key, _, value = arg.partition(" ")
        if key not in _SETTABLE:
            click.echo(f"/set: unknown setting '{key}' (one of {', '.join(_SETTABLE)})")
            return True
        kind = _SETTABLE[key]
        try:
            parsed = kind(value)
        except ValueError:
            click.echo(f"/set: {key} must be {'an integer' if kind is int else 'a number'}, got '{value}'")
            return True
        try:
            params = dataclasses.replace(session.params, **{key: parsed}).check()
        except ValueError as e:
            click.echo(f"/set: {one_line(e)}")
            return True
        session.params = params
        click.echo(f"({key} = {getattr(session.params, key)})")
    elif name == "help":
        click.echo(HELP)
    else:
        click.echo(f"unknown command /{name}; /help lists them")
    return True


def _engine(path: Path, device: str, numerics: str | None, max_batched_tokens: int):
    from ..engine import Engine
    if device == "cuda":
        return Engine(path, "cuda", kv_bytes=CHAT_KV_BYTES, max_running=1, max_len=CHAT_MAX_LEN, numerics=numerics,
                      max_batched_tokens=max_batched_tokens)
    return Engine(path, "cpu", max_len=CHAT_MAX_LEN, numerics=numerics, max_batched_tokens=max_batched_tokens)


@main.command()
@click.argument("model", required=False, type=click.Path(file_okay=False))
@click.option("-p", "--prompt", help="answer this one message and exit")
@click.option("--system", help="system prompt")
@click.option("--temperature", default=0.7, show_default=True, type=float)
@click.option("--top-p", default=0.95, show_default=True, type=float)
@click.option("--top-k", default=0, show_default=True, type=int, help="0 disables the cut")
@click.option("--seed", type=int, help="sampling seed (default: random)")
@click.option("--max-new-tokens", default=512, show_default=True, type=int)
@click.option("--thinking", is_flag=True, help="thinking mode: the model reasons before answering")
@click.option("--device", type=click.Choice(DEVICES), default="auto")
@numerics_option
@max_batched_tokens_option
def chat(model, prompt, system, temperature, top_p, top_k, seed, max_new_tokens, thinking, device, numerics,
         max_batched_tokens):
    """Talk to MODEL (default: the built-in demo model)."""
    from ..chat.session import ChatSession
    params = SamplingParams(temperature, top_p, top_k, max_new_tokens, seed).check()
    path = Path(model) if model else _ensure_demo()
    device = resolve_device(device)
    session = ChatSession(_engine(path, device, numerics, max_batched_tokens), params, thinking, system)
    # The demo's weights are random: its replies are noise, which a newcomer should hear every time.
    random = " (the demo model: random weights, its replies are noise)" if model is None else ""
    if prompt is not None:
        if random:
            click.echo(f"dsv4rt chat: {path}{random}", err=True)
        if not _say(session, prompt):
            sys.exit(1)
        return
    interactive = sys.stdin.isatty()
    where = "the GPU" if device == "cuda" else "the CPU"
    banner = f"dsv4rt chat: {path} on {where}{random}."
    if interactive:
        click.echo(f"{banner} /help for commands, Ctrl-D to leave.")
    elif random:
        click.echo(banner, err=True)
    while True:
        try:
            line = input(">>> " if interactive else "")
        except EOFError:
            break
        except KeyboardInterrupt:
            click.echo("")
            continue
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            if not _command(session, line):
                break
            continue
        _say(session, line)
    if interactive:
        click.echo("")
