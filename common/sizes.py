"""Sizes in bytes as flags give them: '1073741824', '1GiB', '512MiB', '2G' (binary units)."""

from __future__ import annotations

import argparse
import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """'1073741824', '1GiB', '512MiB', '2G' -> bytes (binary units)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 2147483648 or 2GiB)")
    value, unit = float(m.group(1)), m.group(2).lower()
    return int(value * 1024 ** " kmgt".index(unit or " "))
