"""Opening the files a user points at, refusing anything but a regular file before reading a byte:
a FIFO would block the reader forever, a device can be endless, a folder cannot be read or mapped."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Callable

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def open_regular(path: str | Path, error: Callable[[str], Exception]) -> int:
    """A read-only descriptor of `path`; `error(message)` (an exception class, or a function making one), with
    one line naming the file, when it is not a regular file."""
    try:
        # O_NONBLOCK: opening a FIFO without a writer returns at once instead of waiting for one
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise error(f"{path}: cannot open ({e.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = next((name for test, name in _KINDS if test(mode)), "a special file")
        raise error(f"{path}: is {kind}, not a regular file")
    return fd


def json_int(text: str, most: int = 20) -> int:
    """json.loads' parse_int: Python itself refuses integers past 4300 digits, with advice about its own
    limit; no size, offset or id in a file we read needs more than 20 (`most`)."""
    digits = len(text.lstrip("-"))
    if digits > most:
        raise ValueError(f"an integer of {digits} digits")
    return int(text)


def load_json(data: bytes, most: int = 20, object_pairs_hook=None):
    """The UTF-8 JSON `data`, its integers limited to `most` digits (json_int). Raises ValueError
    (UnicodeDecodeError, json.JSONDecodeError, json_int's) or RecursionError; each reader words its own error."""
    return json.loads(data.decode("utf-8"), parse_int=lambda digits: json_int(digits, most),
                      object_pairs_hook=object_pairs_hook)


def is_int(v) -> bool:
    """An integer of a JSON document or a Python caller: int, but not bool (a subclass of int)."""
    return isinstance(v, int) and not isinstance(v, bool)


def read_regular(path: str | Path, error: Callable[[str], Exception]) -> bytes:
    fd = open_regular(path, error)
    try:
        with os.fdopen(fd, "rb") as f:
            return f.read()
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror})") from None
