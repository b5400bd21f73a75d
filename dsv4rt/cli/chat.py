"""`dsv4rt chat`: a terminal conversation with streamed tokens."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from . import main
from .common import DEVICES, resolve_device
from ..reference.sampling import SamplingParams

HELP = """commands:
  /exit                 leave (Ctrl-D does the same)
  /clear                forget the conversation
  /system TEXT          set the system prompt (and clear)
  /set NAME VALUE       temperature, top_p, top_k, max_new_tokens or seed
  /help                 this text
Ctrl-C stops the current reply."""

CHAT_MAX_LEN = 1 << 16        # positions of one conversation on the GPU
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
        make_tiny(path, "demo", seed=0)
    return path


def _say(session, text: str) -> None:
    from ..chat.session import Reply
    out = Reply()
    try:
        for piece in session.reply(text, out):
            sys.stdout.write(piece)
            sys.stdout.flush()
    except KeyboardInterrupt:
        sys.stdout.write(" [stopped]")
    sys.stdout.write("\n")
    sys.stdout.flush()


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
        try:
            old = getattr(session.params, key)
            setattr(session.params, key, _SETTABLE[key](value))
            session.params.check()
        except ValueError as e:
            setattr(session.params, key, old)
            click.echo(f"/set: {e}")
            return True
        if key == "seed":
            session.reseed()
        click.echo(f"({key} = {getattr(session.params, key)})")
    elif name == "help":
        click.echo(HELP)
    else:
        click.echo(f"unknown command /{name}; /help lists them")
    return True


def _generator(path: Path, device: str, numerics: str | None):
    from ..chat.session import Generator, GpuGenerator
    if device == "cuda":
        from ..model.forward import GpuModel
        return GpuGenerator(GpuModel(path, max_len=CHAT_MAX_LEN, kv_bytes=CHAT_KV_BYTES, numerics=numerics))
    from ..reference import load_model
    return Generator(load_model(path, numerics))


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
@click.option("--numerics", type=click.Choice(["exact", "faithful"]), help="default: faithful for fp8 checkpoints")
def chat(model, prompt, system, temperature, top_p, top_k, seed, max_new_tokens, thinking, device, numerics):
    """Talk to MODEL (default: the built-in demo model)."""
    from ..chat import load_tokenizer
    from ..chat.session import ChatSession
    params = SamplingParams(temperature, top_p, top_k, max_new_tokens, seed).check()
    path = Path(model) if model else _ensure_demo()
    device = resolve_device(device)
    session = ChatSession(_generator(path, device, numerics), load_tokenizer(path), params, thinking, system)
    if prompt is not None:
        _say(session, prompt)
        return
    interactive = sys.stdin.isatty()
    if interactive:
        where = "the GPU" if device == "cuda" else "the CPU"
        click.echo(f"dsv4rt chat: {path} on {where}. /help for commands, Ctrl-D to leave.")
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
