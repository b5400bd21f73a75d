"""Opening the files a user points at, refusing anything but a regular file before reading a byte:
a FIFO would block the reader forever, a device can be endless, a folder cannot be read or mapped."""
from __future__ import annotations

import os
import stat
from pathlib import Path

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def open_regular(path: str | Path, error: type[Exception]) -> int:
    """A read-only descriptor of `path`; `error` with one line naming the file when it is not a regular file."""
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


def read_regular(path: str | Path, error: type[Exception]) -> bytes:
    fd = open_regular(path, error)
    try:
        with os.fdopen(fd, "rb") as f:
            return f.read()
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror})") from None
