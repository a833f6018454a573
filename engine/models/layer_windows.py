"""Each decoder layer's sliding window, read from an HF config as transformers reads it.

- `layer_types` (transformers builds it for Qwen2/Qwen3 from `use_sliding_window`, `sliding_window` and
  `max_window_layers`: layer i slides when i >= max_window_layers; Gemma-style configs list it outright): a
  "sliding_attention" layer gets `sliding_window`, a "full_attention" layer none.
- Without `layer_types`: `max_window_layers` splits the layers the same way when the config has it (older
  transformers), else `sliding_window` applies to every layer (Mistral), unless `use_sliding_window` is False.

A window is the number of most recent keys a query sees, itself included (HF's masks). Bad values (a window that is
not a positive integer, max_window_layers outside 0..num_hidden_layers, layer_types of the wrong length or kind)
are a one-line ModelLoadError.
"""

from __future__ import annotations

from kvgate.common.errors import ModelLoadError

LAYER_TYPES = ("full_attention", "sliding_attention")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def layer_windows(config, max_positions: int | None = None) -> list[int | None]:
    """One window per layer (None: full attention). A window of max_positions or more attends like full attention
    and is returned as None (no mask to build, and no block it would let go)."""
    num_layers = config.num_hidden_layers
    sliding = getattr(config, "use_sliding_window", True) is not False
    window = getattr(config, "sliding_window", None) if sliding else None
    if window is not None and (not _is_int(window) or window <= 0):
        raise ModelLoadError(f"config.json: sliding_window must be a positive integer, got {_short(window)}")
    split = getattr(config, "max_window_layers", None) if window is not None else None
    if split is not None and (not _is_int(split) or not 0 <= split <= num_layers):
        raise ModelLoadError(f"config.json: max_window_layers must be an integer in 0..num_hidden_layers "
                             f"({num_layers}), got {_short(split)}")
    types = getattr(config, "layer_types", None)
    if types is not None:
        if not isinstance(types, (list, tuple)) or len(types) != num_layers:
            raise ModelLoadError(f"config.json: layer_types must list one type per layer ({num_layers}), got "
                                 f"{_short(types)}")
        unknown = sorted({str(t) for t in types} - set(LAYER_TYPES))
        if unknown:
            raise ModelLoadError(f"config.json: layer_types {unknown} are not supported (only full_attention and "
                                 "sliding_attention layers run on kvgate's paged attention)")
        slides = [t == "sliding_attention" for t in types]
        if any(slides) and window is None and sliding:
            raise ModelLoadError("config.json: layer_types has sliding_attention layers but sliding_window is not set")
    else:
        slides = [i >= (split or 0) for i in range(num_layers)]
    if window is None or (max_positions is not None and window >= max_positions):
        return [None] * num_layers
    return [window if s else None for s in slides]


def freeable_window(windows: list[int | None]) -> int | None:
    """The window outside which a sequence's KV blocks are read by no layer again: the largest of the layers'
    windows when every layer slides, else None (a full-attention layer reads every block until the end)."""
    if not windows or any(w is None for w in windows):
        return None
    return max(windows)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
