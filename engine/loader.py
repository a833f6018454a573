"""Load an HF model folder: config, tokenizer, safetensors weights (single file or sharded)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from kvgate.engine.errors import ModelLoadError


def load_hf_config(model_path: str | Path):
    from transformers import AutoConfig

    path = Path(model_path)
    if not path.is_dir():
        raise ModelLoadError(f"model folder {str(path)!r} does not exist (give a local HF model folder or 'demo')")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model folder {str(path)!r} has no config.json")
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {exc}") from exc


def load_tokenizer(model_path: str | Path, tokenizer_path: str | Path | None = None):
    from transformers import AutoTokenizer

    path = str(tokenizer_path or model_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load a tokenizer from {path!r}: {exc}") from exc
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise ModelLoadError(f"the tokenizer in {path!r} has no fast (tokenizers) backend")
    return tokenizer


def safetensors_files(model_path: str | Path) -> list[Path]:
    path = Path(model_path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"sharded checkpoint in {str(path)!r} lacks {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        kind = " (only PyTorch .bin weights, which are not loaded; convert them to safetensors)" if any(
            path.glob("*.bin")) else ""
        raise ModelLoadError(f"model folder {str(path)!r} has no .safetensors weights{kind}")
    return files


def iterate_weights(model_path: str | Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    for file in safetensors_files(model_path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name).to(dtype)
