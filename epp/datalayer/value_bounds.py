"""What a scraped number may be: the range of each Model Server Protocol value, and the record of what a page
carried outside it.

An engine's /metrics page is input: the engines a pool scrapes are not all kvgate's (any vLLM-compatible server,
a sidecar, a buggy build, a compromised pod). Every value the datalayer reads is checked here before scheduling
sees it. A sample that is not a finite number, lies outside its range, or sits in a family with more label sets
than any engine exports is dropped — the family then reads as if the engine had not exported those samples —
and recorded in the parse's Rejections as (family, reason), which the collector counts per endpoint
(kvgate_epp_endpoint_metric_values_rejected_total) and logs, rate-limited. The ranges are far beyond any real
engine's and well inside what the scheduler's arithmetic takes (float conversions, int(), products of two).
"""

from __future__ import annotations

import math

MAX_REQUESTS = 1_000_000  # waiting or running requests in one sample
MAX_BLOCK_SIZE = 1 << 16  # tokens per KV block
MAX_KV_BLOCKS = 1 << 32  # KV blocks of one engine
MAX_TOKENS = float(1 << 40)  # a prefill backlog in tokens
MAX_COUNTER = float(1 << 53)  # a counter: past this, float64 no longer tells two consecutive values apart
MAX_STEP_AGE_S = 86_400.0  # how long the engine's running step has run
MAX_LORAS = 4096  # max_lora of the LoRA info gauge
MAX_ADAPTERS = 1024  # adapter names in one running/waiting label
MAX_ADAPTER_NAME = 256  # characters of one adapter name
MAX_SERIES = 1024  # label sets of one family (an engine exports a few: per model, per data-parallel rank)
MAX_INFO_SERIES = 16384  # of the LoRA info gauge, which keeps a label set per adapter combination it has seen
MAX_INT_LABEL_DIGITS = 12  # an integer carried in a label (block_size, num_gpu_blocks, max_lora)
EXAMPLE_CHARS = 40  # of a rejected value, in the log

NON_FINITE, OUT_OF_RANGE, BAD_LABEL, TOO_MANY_SERIES = "non_finite", "out_of_range", "bad_label", "too_many_series"
REASONS = (NON_FINITE, OUT_OF_RANGE, BAD_LABEL, TOO_MANY_SERIES)


class Rejections:
    """What one parse dropped: (family, reason) → count, and the first value of each, shortened."""

    __slots__ = ("counts", "examples")

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] = {}
        self.examples: dict[tuple[str, str], str] = {}

    def add(self, family: str, reason: str, value: object) -> None:
        key = (family, reason)
        self.counts[key] = self.counts.get(key, 0) + 1
        if key not in self.examples:
            text = str(value)
            self.examples[key] = text if len(text) <= EXAMPLE_CHARS else text[:EXAMPLE_CHARS] + "..."

    def __bool__(self) -> bool:
        return bool(self.counts)


def in_range(value: float, low: float, high: float, family: str, rejections: Rejections | None) -> bool:
    """Whether `value` is finite and within [low, high]; a rejection recorded otherwise."""
    if not math.isfinite(value):
        reason = NON_FINITE
    elif low <= value <= high:
        return True
    else:
        reason = OUT_OF_RANGE
    if rejections is not None:
        rejections.add(family, reason, value)
    return False


def int_label(text: str | None, low: int, high: int) -> int | None | bool:
    """An integer label's value: None when absent or empty, False when malformed or out of [low, high]."""
    if not text:
        return None
    if len(text) > MAX_INT_LABEL_DIGITS or not text.isascii() or not text.isdigit():
        return False
    value = int(text)
    return value if low <= value <= high else False
