"""Helpers shared by the commands: backend choice and atomic output files."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(name: str) -> str:
    """The numpy reference is the only backend so far: `auto` means cpu, `cuda` is refused clearly."""
    if name == "cuda":
        raise ValueError("--device cuda: this build has no GPU backend yet; use --device cpu")
    return "cpu"


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
