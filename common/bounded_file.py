"""A file read whole, within a byte limit: a path given by mistake (weights, a log, /dev/zero, a FIFO) is refused
instead of read into memory, or waited on for ever.

`read_bytes` refuses, with a FileLimitError (a ValueError) naming the limit, what is not a regular file (checked
on the opened descriptor: opened non-blocking, so a FIFO does not wait for a writer) and a file of more than
`max_bytes` bytes (at most `max_bytes` + 1 are read, whatever the file says its size is); the message does not
name the file, its caller does. OSError (missing, no permission) passes through.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class FileLimitError(ValueError):
    """Not a regular file, or larger than the limit for its kind."""


def read_bytes(path: str | os.PathLike, max_bytes: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise FileLimitError("not a regular file")
        chunks, size = [], 0
        while size <= max_bytes:
            chunk = os.read(fd, min(max_bytes + 1 - size, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > max_bytes:
        raise FileLimitError(f"larger than {size_text(max_bytes)}, the limit for this file")
    return b"".join(chunks)


def read_text(path: str | os.PathLike, max_bytes: int) -> str:
    """The file as UTF-8 text (UnicodeDecodeError, a ValueError, when it is not)."""
    return read_bytes(Path(path), max_bytes).decode("utf-8")


def size_text(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else \
        f"{n >> 10} KiB" if n >= 1 << 10 and n % (1 << 10) == 0 else f"{n} bytes"
