"""JSON that kvgate's programs read from files and flags, with bounded size and nesting.

`json.loads` trusts the document's shape:
- nesting: its scanner recurses once per level, so `[[[[...` 100000 deep escapes as RecursionError, a
  30-line traceback where a one-line error was due (and libraries that parse the same file later, such as
  transformers reading a model's config.json, do the same);
- size: a path given by mistake (weights, a log) is read whole.

`loads` refuses, with a JSONLimitError (a ValueError) naming the limit, a text over `max_bytes` (bytes, or
characters for a str) and nesting deeper than `max_depth` before json.loads runs: the depth comes from a linear
scan of the brackets outside strings (strings and everything else are cut out by regular expressions, and the
running depth is summed in C, about as fast as json.loads itself). Not JSON at all is json's own
JSONDecodeError, also a ValueError. `read` does the same for a file (common/bounded_file.py: a regular file, at
most `max_bytes` read), and `check_file` only checks, for a file another library parses (transformers' config,
generation config and tokenizer files).

The limits below, by kind of input, are generous for real files: a bigger one is a wrong path or an attack.
"""

from __future__ import annotations

import json
import os
import re
from itertools import accumulate
from typing import Any

from kvgate.common.bounded_file import FileLimitError, read_bytes, size_text

MAX_DEPTH = 64  # levels of objects and arrays (real configs and tokenizers use under 10)
FLAG_BYTES = 64 << 10  # a JSON flag value (--speculative-config, ...): a few keys; Linux caps one at 128 KiB
CONFIG_BYTES = 16 << 20  # config.json, generation_config.json, tokenizer_config.json, adapter_config.json, ...
TOKENIZER_BYTES = 128 << 20  # tokenizer.json / vocab.json: the vocabulary and merges (tens of MiB for 256k tokens)
INDEX_BYTES = 64 << 20  # model.safetensors.index.json: one line per tensor

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r'[^\[\]{}"]+')
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


class JSONLimitError(FileLimitError):
    """Nested deeper, or larger, than the limit for its kind (a ValueError, as json's own errors are)."""


def check_depth(text: str, max_depth: int = MAX_DEPTH) -> None:
    """JSONLimitError when `text`'s brackets outside strings nest deeper than `max_depth`."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    quote = brackets.find('"')
    if quote >= 0:  # an unterminated string: json stops there, and so does its nesting
        brackets = brackets[:quote]
    if max(accumulate(map(_STEP.__getitem__, brackets)), default=0) > max_depth:
        raise JSONLimitError(f"nested deeper than {max_depth} levels")


def loads(data: str | bytes, max_bytes: int, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON value in `data` (UTF-8 when bytes), within the limits (else JSONLimitError)."""
    if len(data) > max_bytes:
        unit = size_text(max_bytes) if isinstance(data, bytes) else f"{max_bytes} characters"
        raise JSONLimitError(f"larger than {unit}, the limit for this input")
    text = data.decode("utf-8") if isinstance(data, bytes) else data
    check_depth(text, max_depth)
    return json.loads(text)


def read(path: str | os.PathLike, max_bytes: int, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON value in the file at `path`, within the limits; OSError when it cannot be opened."""
    return loads(read_bytes(path, max_bytes), max_bytes, max_depth)


def check_file(path: str | os.PathLike, max_bytes: int, max_depth: int = MAX_DEPTH) -> None:
    """That the file at `path` is a regular file within `max_bytes` whose nesting is within `max_depth` (for a
    file another library then parses). Its JSON syntax is that library's to judge."""
    check_depth(read_bytes(path, max_bytes).decode("utf-8", errors="replace"), max_depth)
