"""A model folder's tokenizer, loaded by the engine and by the EPP's precise prefix scorer: the JSON files
transformers parses are checked for size and depth first, and only a fast (tokenizers) backend is accepted.
Nothing here imports torch."""

from __future__ import annotations

import os
from pathlib import Path

from kvgate.common import bounded_json
from kvgate.common.errors import ModelLoadError

# The tokenizer files transformers parses (with json.loads: no bound on size or nesting), with the size each may
# have; each present is checked against it and bounded_json.MAX_DEPTH first.
TOKENIZER_FILES = {"tokenizer.json": bounded_json.TOKENIZER_BYTES, "vocab.json": bounded_json.TOKENIZER_BYTES,
                   "tokenizer_config.json": bounded_json.CONFIG_BYTES,
                   "special_tokens_map.json": bounded_json.CONFIG_BYTES,
                   "added_tokens.json": bounded_json.CONFIG_BYTES, "chat_template.json": bounded_json.CONFIG_BYTES}


def check_json_files(folder: str | Path, files: dict[str, int]) -> None:
    """ModelLoadError naming the file and the limit when one of `files` in `folder` is over its size, nested
    deeper than bounded_json.MAX_DEPTH or not a regular file (absent files are the reader's to miss)."""
    for name, max_bytes in files.items():
        path = Path(folder) / name
        if not os.path.lexists(path):
            continue
        try:
            bounded_json.check_file(path, max_bytes)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read {path}: {exc}") from None


def load_tokenizer(model_path: str | Path, tokenizer_path: str | Path | None = None):
    from transformers import AutoTokenizer

    path = str(tokenizer_path or model_path)
    if Path(path).is_dir():
        check_json_files(path, TOKENIZER_FILES)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load a tokenizer from {path!r}: {exc}") from exc
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise ModelLoadError(f"the tokenizer in {path!r} has no fast (tokenizers) backend")
    return tokenizer
