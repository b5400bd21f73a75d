"""Helpers shared by the commands: backend choice, shared options, option names and atomic output files."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import click
import numpy as np

from ..kv.plan import NUMERICS

DEVICES = ("auto", "cpu", "cuda")

# docs/numerics.md#modes, on every command that runs or plans a model
numerics_option = click.option(
    "--numerics", type=click.Choice(NUMERICS),
    help="default: faithful for fp8 checkpoints; fast also rounds wo_a's input to fp8 (opt-in, as vLLM)")

# the engine's step size, on every command that runs one
max_batched_tokens_option = click.option(
    "--max-batched-tokens", default=8192, show_default=True, type=click.IntRange(1),
    help="tokens of one step, decode rows and prefill chunks together (one prompt's chunk may take all)")


def resolve_device(name: str) -> str:
    """`auto` is cuda when a GPU is visible, else cpu."""
    from ..cuda.driver import gpu_visible
    if name == "cuda":
        if not gpu_visible():
            raise ValueError("--device cuda: no NVIDIA GPU visible")
        return "cuda"
    if name == "auto" and gpu_visible():
        return "cuda"
    return "cpu"


def one_line(e: BaseException) -> str:
    """An error as the one line a command prints after "error: "."""
    if isinstance(e, MemoryError):
        return "out of host memory"
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def option_name(field: str) -> str:
    """The command-line spelling of a SamplingParams field, for its error messages."""
    return "--" + field.replace("_", "-")


def save_npy_atomic(path: str | Path, array: np.ndarray) -> None:
    """Write next to the target and rename, so a failure never leaves a partial file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".npy", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
