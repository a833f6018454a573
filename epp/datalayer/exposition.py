"""The Prometheus text exposition, read the targeted way: only the families a dialect names.

`iter_samples` jumps with `str.find` to a family's sample lines and walks only that group of lines, so the
cost does not grow with the histograms and counters the page also carries. `parse_metrics` turns one page
into the Model Server Protocol numbers (EndpointMetrics) of a Dialect.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterator

from kvgate.common.engine_latency_protocol import TPOT_FEATURES, TTFT_FEATURES
from kvgate.epp.datalayer.dialects import Dialect, Series
from kvgate.epp.datalayer.value_bounds import (BAD_LABEL, MAX_BLOCK_SIZE, MAX_COUNTER, MAX_INFO_SERIES, MAX_KV_BLOCKS,
                                               MAX_LORAS, MAX_REQUESTS, MAX_SERIES, MAX_STEP_AGE_S, MAX_TOKENS,
                                               TOO_MANY_SERIES, MAX_ADAPTER_NAME, MAX_ADAPTERS, Rejections, in_range,
                                               int_label)
from kvgate.epp.types import EndpointMetrics


class MetricsParseError(ValueError):
    pass


def iter_samples(text: str, name: str) -> Iterator[tuple[str, float]]:
    """(label text between the braces, value) of each sample line of the family `name`; a value that does not
    parse as a number is NaN (the caller's checks drop it, value_bounds.py).

    The exposition format keeps a family's samples in one group of lines, so after the first sample the scan
    only walks the following lines and stops at the group's end: it never reads the rest of the page.
    """
    n = len(name)
    needle = "\n" + name
    in_group = False
    if text.startswith(name):
        line = 0
    else:
        found = text.find(needle)
        line = found + 1 if found >= 0 else -1
    while line >= 0:
        after = line + n
        end = text.find("\n", after)
        if end < 0:
            end = len(text)
        c = text[after:after + 1]
        labels = None
        if c == "{":
            close = text.rfind("}", after, end)
            if close > after:
                labels, rest = text[after + 1:close], text[close + 1:end]
        elif c == " " or c == "\t":
            labels, rest = "", text[after:end]
        if labels is not None:  # else a longer family name that merely starts with `name`
            in_group = True
            parts = rest.split(None, 1)
            if parts:
                try:
                    value = float(parts[0])
                except ValueError:
                    value = math.nan
                yield labels, value
        if in_group:
            line = end + 1 if text.startswith(name, end + 1) else -1
        else:
            found = text.find(needle, end)
            line = found + 1 if found >= 0 else -1


_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')
CACHED_LABEL_CHARS = 4096  # label texts up to this long are decoded once and cached; longer ones every time


def _cached_when_short(maxsize: int):
    """An LRU cache of `maxsize` over a label-text decoder, for texts of at most CACHED_LABEL_CHARS: the info
    gauges' label text repeats scrape after scrape, and a page of distinct megabyte labels cannot fill it."""
    def wrap(decode):
        cached = functools.lru_cache(maxsize=maxsize)(decode)

        @functools.wraps(decode)
        def lookup(text: str):
            return cached(text) if len(text) <= CACHED_LABEL_CHARS else decode(text)
        return lookup
    return wrap


def parse_labels(text: str) -> dict[str, str]:
    """The labels of one sample; a fresh dict (callers may keep or change it)."""
    return dict(_labels(text))


@_cached_when_short(4096)  # ~5 us -> ~0.3 us for a text seen before
def _labels(text: str) -> tuple[tuple[str, str], ...]:
    return tuple((k, v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")) for k, v in _LABEL.findall(text))


def _samples(text: str, series: Series, family_limit: int = MAX_SERIES, rejections: Rejections | None = None
             ) -> list[tuple[str, float]]:
    """The samples of `series` (its family narrowed to its label values), at most `family_limit` of the family;
    past that the family yields nothing (a rejection recorded)."""
    found = []
    for sample in iter_samples(text, series.name):
        if len(found) == family_limit:
            _reject(rejections, series.name, TOO_MANY_SERIES, f"over {family_limit} samples")
            return []
        found.append(sample)
    if not series.labels:
        return found
    return [(labels, v) for labels, v in found
            if all(parse_labels(labels).get(k) == want for k, want in series.labels)]


def _values(text: str, series: Series, low: float, high: float, rejections: Rejections | None) -> list[float]:
    """The values of `series` within [low, high]; the others dropped and recorded."""
    out = []
    for _, v in _samples(text, series, MAX_SERIES, rejections):
        if low <= v <= high:  # False for NaN; ±Inf is past any finite bound
            out.append(v)
        else:
            in_range(v, low, high, series.name, rejections)
    return out


def _first(text: str, choices: tuple[Series, ...], low: float, high: float, rejections: Rejections | None
           ) -> list[float] | None:
    for series in choices:
        values = _values(text, series, low, high, rejections)
        if values:
            return values
    return None


def _adapters(value: str) -> frozenset[str] | None:
    """The adapter names of a running/waiting label; None past MAX_ADAPTERS names or MAX_ADAPTER_NAME characters."""
    names = frozenset(a for a in (s.strip() for s in value.split(",", MAX_ADAPTERS)) if a)
    if len(names) > MAX_ADAPTERS or any(len(a) > MAX_ADAPTER_NAME for a in names):
        return None
    return names


# The info gauges' labels are the same scrape after scrape: decoding them once per distinct text took a
# filtered vLLM page's parse from 14.5 to ~9 us of CPU (micro-benchmark; see bench.py).
@_cached_when_short(1024)
def _lora_state(labels_text: str) -> tuple[int, frozenset[str], frozenset[str]] | None:
    """(max_lora, running, waiting) of a LoRA info sample; None when a label is out of its range."""
    labels = parse_labels(labels_text)
    max_lora = int_label(labels.get("max_lora"), 0, MAX_LORAS)
    running, waiting = (_adapters(labels.get("running_lora_adapters", "")),
                        _adapters(labels.get("waiting_lora_adapters", "")))
    if max_lora is False or running is None or waiting is None:
        return None
    return max_lora or 0, running, waiting


@_cached_when_short(1024)
def _cache_state(labels_text: str) -> tuple[int | None, int | None] | None:
    """(block_size, num_gpu_blocks) of a cache info sample; None when either is malformed or out of range."""
    labels = parse_labels(labels_text)
    size = int_label(labels.get("block_size"), 1, MAX_BLOCK_SIZE)
    blocks = int_label(labels.get("num_gpu_blocks"), 0, MAX_KV_BLOCKS)
    if size is False or blocks is False:
        return None
    return size, blocks


def parse_metrics(text: str, dialect: Dialect, updated_at: float = 0.0, rejections: Rejections | None = None
                  ) -> EndpointMetrics:
    """The numbers scheduling needs from one /metrics page; MetricsParseError if it has none of them.

    Every value is checked against its range (value_bounds.py): what is dropped is recorded in `rejections`."""
    r = rejections
    waiting = _first(text, dialect.waiting, 0, MAX_REQUESTS, r)
    running = _first(text, dialect.running, 0, MAX_REQUESTS, r)
    usage = _first(text, dialect.kv_usage, 0.0, 1.0 + USAGE_SLACK, r)
    if waiting is None and running is None and usage is None:
        raise MetricsParseError("no queue, running or KV-usage metric found")
    m = EndpointMetrics(
        waiting_queue_size=int(sum(waiting)) if waiting else 0,
        running_requests=int(sum(running)) if running else 0,
        kv_cache_usage=min(1.0, max(usage)) if usage else 0.0,
        updated_at=updated_at,
    )
    if dialect.lora_info:
        latest = max((s for s in _samples(text, Series(dialect.lora_info), MAX_INFO_SERIES, r)
                      if in_range(s[1], -MAX_COUNTER, MAX_COUNTER, dialect.lora_info, r)),
                     key=lambda s: s[1], default=None)
        if latest is not None:  # the value is a timestamp: the newest sample is the current state
            state = _lora_state(latest[0])
            if state is None:
                _reject(r, dialect.lora_info, BAD_LABEL, latest[0])
            else:
                m.max_lora, m.running_loras, m.waiting_loras = state
    if dialect.cache_info:
        for labels_text, _ in _samples(text, Series(dialect.cache_info), MAX_SERIES, r):
            state = _cache_state(labels_text)
            if state is None:
                _reject(r, dialect.cache_info, BAD_LABEL, labels_text)
            else:
                m.kv_block_size, m.num_kv_blocks = state
            break
    if dialect.block_size is not None:
        values = _values(text, dialect.block_size, 1, MAX_BLOCK_SIZE, r)
        m.kv_block_size = int(values[0]) if values else None
    if dialect.num_blocks is not None:
        values = _values(text, dialect.num_blocks, 0, MAX_KV_BLOCKS, r)
        m.num_kv_blocks = int(values[0]) if values else None
    if dialect.prefill_pending is not None:
        values = _values(text, dialect.prefill_pending, 0, MAX_TOKENS, r)
        m.prefill_tokens_pending = int(sum(values)) if values else None
    if dialect.prefill_awaiting_step is not None and dialect.step_age is not None:
        awaiting = _values(text, dialect.prefill_awaiting_step, 0, MAX_TOKENS, r)
        age = _values(text, dialect.step_age, 0.0, MAX_STEP_AGE_S, r)
        if awaiting and age:
            m.prefill_tokens_awaiting_step, m.step_age_s = int(sum(awaiting)), max(age)
    if dialect.prefix_queries is not None and dialect.prefix_hits is not None:
        queries = _values(text, dialect.prefix_queries, 0, MAX_COUNTER, r)
        hits = _values(text, dialect.prefix_hits, 0, MAX_COUNTER, r)
        if queries and hits:
            m.prefix_cache_queries, m.prefix_cache_hits = sum(queries), sum(hits)
    if dialect.prefill_computed is not None and dialect.prefill_seconds is not None:
        computed = _values(text, dialect.prefill_computed, 0, MAX_COUNTER, r)
        seconds = _values(text, dialect.prefill_seconds, 0, MAX_COUNTER, r)
        if computed and seconds:
            m.prefill_tokens_computed, m.prefill_step_seconds = sum(computed), sum(seconds)
    if dialect.ttft_model and dialect.tpot_model and dialect.model_observations is not None:
        observed = _values(text, dialect.model_observations, 0, MAX_COUNTER, r)
        if observed:
            m.ttft_model_weights = _model_weights(text, dialect.ttft_model, TTFT_FEATURES, r)
            m.tpot_model_weights = _model_weights(text, dialect.tpot_model, TPOT_FEATURES, r)
            m.ttft_model_observations = sum(observed)
    return m


USAGE_SLACK = 1e-6  # a KV usage this far past 1 is rounding (read as 1); further is out of range
MAX_MODEL_WEIGHT = 1e6  # seconds per feature unit: past this a published weight is not a latency model's


def _reject(rejections: Rejections | None, family: str, reason: str, value: object) -> None:
    if rejections is not None:
        rejections.add(family, reason, value)


def _model_weights(text: str, name: str, features: tuple[str, ...], rejections: Rejections | None
                   ) -> tuple[float, ...] | None:
    """A published latency model's weights in `features`' order; None unless every feature has one finite, bounded
    weight (a partial or absurd model is not used)."""
    found: dict[str, float] = {}
    for labels_text, value in _samples(text, Series(name), len(features), rejections):
        if not in_range(value, -MAX_MODEL_WEIGHT, MAX_MODEL_WEIGHT, name, rejections):
            return None
        feature = parse_labels(labels_text).get("feature")
        if feature in found:
            _reject(rejections, name, BAD_LABEL, labels_text)
            return None
        if feature is not None:
            found[feature] = value
    if set(found) != set(features):
        return None
    return tuple(found[f] for f in features)


def comparable(m: EndpointMetrics) -> tuple:
    """The numbers of `m` that listeners care about (all but updated_at), for change detection."""
    return (m.waiting_queue_size, m.running_requests, m.kv_cache_usage, m.max_lora, m.running_loras,
            m.waiting_loras, m.kv_block_size, m.num_kv_blocks, m.prefill_tokens_pending, m.prefill_tokens_per_s)
