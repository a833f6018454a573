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

from kvgate.engine_latency_protocol import TPOT_FEATURES, TTFT_FEATURES
from kvgate.epp.datalayer.dialects import Dialect, Series
from kvgate.epp.types import EndpointMetrics


class MetricsParseError(ValueError):
    pass


def iter_samples(text: str, name: str) -> Iterator[tuple[str, float]]:
    """(label text between the braces, value) of each sample line of the family `name`.

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
            parts = rest.split()
            if parts:
                try:
                    value = float(parts[0])
                except ValueError:
                    value = None
                if value is not None and value == value:  # drop NaN
                    yield labels, value
        if in_group:
            line = end + 1 if text.startswith(name, end + 1) else -1
        else:
            found = text.find(needle, end)
            line = found + 1 if found >= 0 else -1


_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


def parse_labels(text: str) -> dict[str, str]:
    """The labels of one sample; a fresh dict (callers may keep or change it)."""
    return dict(_parsed_labels(text))


@functools.lru_cache(maxsize=4096)  # the info gauges' label text repeats scrape after scrape: ~5 us -> ~0.3 us
def _parsed_labels(text: str) -> tuple[tuple[str, str], ...]:
    return tuple((k, v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")) for k, v in _LABEL.findall(text))


def _values(text: str, series: Series) -> list[float]:
    if not series.labels:
        return [v for _, v in iter_samples(text, series.name)]
    out = []
    for labels, v in iter_samples(text, series.name):
        parsed = parse_labels(labels)
        if all(parsed.get(k) == want for k, want in series.labels):
            out.append(v)
    return out


def _first(text: str, choices: tuple[Series, ...]) -> list[float] | None:
    for series in choices:
        values = _values(text, series)
        if values:
            return values
    return None


def _adapters(value: str) -> frozenset[str]:
    return frozenset(a for a in (s.strip() for s in value.split(",")) if a)


# The info gauges' labels are the same scrape after scrape: decoding them once per distinct text took a
# filtered vLLM page's parse from 14.5 to ~9 us of CPU (micro-benchmark; see bench.py).
@functools.lru_cache(maxsize=1024)
def _lora_state(labels_text: str) -> tuple[int, frozenset[str], frozenset[str]]:
    labels = parse_labels(labels_text)
    try:
        max_lora = int(labels.get("max_lora", "0") or 0)
    except ValueError:
        max_lora = 0
    return (max_lora, _adapters(labels.get("running_lora_adapters", "")),
            _adapters(labels.get("waiting_lora_adapters", "")))


@functools.lru_cache(maxsize=1024)
def _cache_state(labels_text: str) -> tuple[int | None, int | None]:
    labels = parse_labels(labels_text)
    return _int_or_none(labels.get("block_size")), _int_or_none(labels.get("num_gpu_blocks"))


def parse_metrics(text: str, dialect: Dialect, updated_at: float = 0.0) -> EndpointMetrics:
    """The numbers scheduling needs from one /metrics page; MetricsParseError if it has none of them."""
    waiting, running, usage = _first(text, dialect.waiting), _first(text, dialect.running), \
        _first(text, dialect.kv_usage)
    if waiting is None and running is None and usage is None:
        raise MetricsParseError("no queue, running or KV-usage metric found")
    m = EndpointMetrics(
        waiting_queue_size=int(sum(waiting)) if waiting else 0,
        running_requests=int(sum(running)) if running else 0,
        kv_cache_usage=min(1.0, max(0.0, max(usage))) if usage else 0.0,
        updated_at=updated_at,
    )
    if dialect.lora_info:
        latest = max(iter_samples(text, dialect.lora_info), key=lambda s: s[1], default=None)
        if latest is not None:  # the value is a timestamp: the newest sample is the current state
            m.max_lora, m.running_loras, m.waiting_loras = _lora_state(latest[0])
    if dialect.cache_info:
        for labels_text, _ in iter_samples(text, dialect.cache_info):
            m.kv_block_size, m.num_kv_blocks = _cache_state(labels_text)
            break
    if dialect.block_size is not None:
        values = _values(text, dialect.block_size)
        m.kv_block_size = int(values[0]) if values else None
    if dialect.num_blocks is not None:
        values = _values(text, dialect.num_blocks)
        m.num_kv_blocks = int(values[0]) if values else None
    if dialect.prefill_pending is not None:
        values = _values(text, dialect.prefill_pending)
        m.prefill_tokens_pending = int(sum(values)) if values else None
    if dialect.prefill_awaiting_step is not None and dialect.step_age is not None:
        awaiting, age = _values(text, dialect.prefill_awaiting_step), _values(text, dialect.step_age)
        if awaiting and age:
            m.prefill_tokens_awaiting_step, m.step_age_s = int(sum(awaiting)), max(0.0, max(age))
    if dialect.prefix_queries is not None and dialect.prefix_hits is not None:
        queries, hits = _values(text, dialect.prefix_queries), _values(text, dialect.prefix_hits)
        if queries and hits:
            m.prefix_cache_queries, m.prefix_cache_hits = sum(queries), sum(hits)
    if dialect.prefill_computed is not None and dialect.prefill_seconds is not None:
        computed, seconds = _values(text, dialect.prefill_computed), _values(text, dialect.prefill_seconds)
        if computed and seconds:
            m.prefill_tokens_computed, m.prefill_step_seconds = sum(computed), sum(seconds)
    if dialect.ttft_model and dialect.tpot_model and dialect.model_observations is not None:
        observed = _values(text, dialect.model_observations)
        if observed:
            m.ttft_model_weights = _model_weights(text, dialect.ttft_model, TTFT_FEATURES)
            m.tpot_model_weights = _model_weights(text, dialect.tpot_model, TPOT_FEATURES)
            m.ttft_model_observations = sum(observed)
    return m


MAX_MODEL_WEIGHT = 1e6  # seconds per feature unit: past this a published weight is not a latency model's


def _model_weights(text: str, name: str, features: tuple[str, ...]) -> tuple[float, ...] | None:
    """A published latency model's weights in `features`' order; None unless every feature has one finite, bounded
    weight (a partial or absurd model is not used)."""
    found: dict[str, float] = {}
    for labels_text, value in iter_samples(text, name):
        feature = parse_labels(labels_text).get("feature")
        if feature in found or not math.isfinite(value) or abs(value) > MAX_MODEL_WEIGHT:
            return None
        if feature is not None:
            found[feature] = value
    if set(found) != set(features):
        return None
    return tuple(found[f] for f in features)


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value else None
    except ValueError:
        return None


def comparable(m: EndpointMetrics) -> tuple:
    """The numbers of `m` that listeners care about (all but updated_at), for change detection."""
    return (m.waiting_queue_size, m.running_requests, m.kv_cache_usage, m.max_lora, m.running_loras,
            m.waiting_loras, m.kv_block_size, m.num_kv_blocks, m.prefill_tokens_pending, m.prefill_tokens_per_s)
