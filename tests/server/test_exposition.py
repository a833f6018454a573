"""The /metrics page's stats families, written by exposition.render, are byte for byte what prometheus_client's
generate_latest writes for the same families — whole and narrowed by `name[]` — whatever the engine's numbers and
adapter names (the EPP and Prometheus parse this text)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.engine.config import EngineConfig
from kvgate.engine.draft_model import DraftStats
from kvgate.engine.engine_messages import EngineInfo
from kvgate.engine.llm_engine import EngineStats
from kvgate.engine.server import exposition
from kvgate.engine.server.exposition import FamilySpec, render
from kvgate.engine.server.metrics import STATS_FAMILIES, EngineStatsCollector, ServerMetrics
from kvgate.engine.spec_decode import SpecDecodeStats
from kvgate.epp.datalayer.dialects import DIALECTS

counts = st.integers(min_value=0, max_value=2**53)
numbers = st.one_of(counts, st.floats(min_value=0, max_value=1e300, allow_nan=False),
                    st.sampled_from([float("inf"), float("nan"), 1e-320, 123456789.0]))
adapter = st.text(alphabet=st.sampled_from('ab"\\\n,:{}= é'), max_size=8)


@st.composite
def engines(draw):
    stats = None
    if draw(st.booleans()):
        spec = draft = None
        if draw(st.booleans()):
            spec = SpecDecodeStats(draw(counts), draw(counts), draw(counts), draw(st.lists(counts, max_size=4)),
                                   draw(counts))
        if draw(st.booleans()):
            draft = DraftStats(draw(counts), draw(counts), draw(counts))
        stats = EngineStats(num_running=draw(counts), num_waiting=draw(counts), kv_cache_usage=draw(numbers),
                            num_blocks=7, block_size=16, prefix_cache_queries=draw(counts),
                            prefix_cache_hits=draw(counts), num_preemptions=draw(counts),
                            running_lora_adapters=draw(st.lists(adapter, max_size=3)),
                            waiting_lora_adapters=draw(st.lists(adapter, max_size=3)), spec_decode=spec,
                            draft_model=draft, prefill_tokens_computed=draw(counts),
                            prefill_step_seconds=draw(numbers))
    info = EngineInfo(model_name="m", max_model_len=128, vocab_size=262, block_size=16, num_blocks=draw(counts),
                      eos_token_ids=(), tokenizer_path="") if draw(st.booleans()) else None
    config = EngineConfig(model="m", kv_cache_dtype=draw(st.sampled_from(["auto", "fp8", "int8"])),
                          enable_lora=draw(st.booleans()), max_loras=draw(st.integers(1, 8)))
    return SimpleNamespace(stats=stats, info=info, config=config, num_prefill_tokens_pending=draw(counts),
                           num_prefill_tokens_awaiting_step=draw(counts), step_age_s=draw(numbers),
                           num_unfinished=draw(counts))


def clock():
    return 1764331200.125  # the LoRA info gauge's value, the same in both renderings


def _library_text(collector, names=None) -> bytes:
    registry = CollectorRegistry()
    registry.register(collector)
    return generate_latest(registry.restricted_registry(names) if names is not None else registry)


sample_names = [spec.sample_name for spec in STATS_FAMILIES]
EPP_NAMES = frozenset(DIALECTS["vllm"].families())


def _speculating_engine() -> SimpleNamespace:
    # no draft position yet: a family without samples, which a narrowed page leaves out and a whole page lists
    stats = EngineStats(num_running=1, num_waiting=0, kv_cache_usage=0.5, num_blocks=7, block_size=16,
                        prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0, spec_decode=SpecDecodeStats())
    return SimpleNamespace(stats=stats, info=None, config=EngineConfig(model="m"), num_prefill_tokens_pending=0,
                           num_prefill_tokens_awaiting_step=0, step_age_s=0.0,
                           num_unfinished=1)


@settings(max_examples=300, deadline=None)
@example(llm=_speculating_engine(), model="m", names=frozenset({"vllm:spec_decode_num_accepted_tokens_per_pos_total"}))
@example(llm=_speculating_engine(), model="m", names=None)
@given(llm=engines(), model=adapter, names=st.one_of(st.none(), st.just(EPP_NAMES),
                                                      st.frozensets(st.sampled_from(sample_names + ["x", "vllm:a"]))))
def test_render_writes_what_prometheus_client_writes(llm, model, names):
    collector = EngineStatsCollector(llm, model or "m", clock)
    assert render(collector.families(), names).encode() == _library_text(collector, names)


def test_the_page_is_the_stats_then_the_request_metrics():
    llm = SimpleNamespace(stats=None, info=None, config=EngineConfig(model="m"), num_prefill_tokens_pending=3,
                          num_prefill_tokens_awaiting_step=1, step_age_s=0.25,
                          num_unfinished=0)
    metrics = ServerMetrics(llm, "m")
    tracker = metrics.track(num_prompt_tokens=5, num_samples=1)
    tracker.on_tokens(2)
    tracker.close()
    whole = metrics.page().decode()
    families = {f.name: f for f in text_string_to_metric_families(whole)}
    assert families["kvgate:num_prefill_tokens_pending"].samples[0].value == 3
    assert families["kvgate:num_prefill_tokens_awaiting_step"].samples[0].value == 1
    assert families["kvgate:engine_step_age_seconds"].samples[0].value == 0.25
    assert families["vllm:prompt_tokens"].samples[0].value == 5
    assert families["vllm:time_to_first_token_seconds"].type == "histogram"
    narrowed = metrics.page(frozenset({"vllm:num_requests_running", "vllm:generation_tokens_total"})).decode()
    assert narrowed == ('# HELP vllm:num_requests_running Requests in model execution batches.\n'
                        '# TYPE vllm:num_requests_running gauge\n'
                        'vllm:num_requests_running{model_name="m"} 0.0\n'
                        '# HELP vllm:generation_tokens_total Generation tokens processed.\n'
                        '# TYPE vllm:generation_tokens_total counter\n'
                        'vllm:generation_tokens_total{model_name="m"} 2.0\n')
    assert metrics.page(frozenset({"nothing"})) == b""


def test_label_prefixes_are_kept_per_family_and_bounded():
    spec = FamilySpec("kvgate:test_info", "gauge", "A test.", ("b", "a"))
    assert spec.sample_line(("x", 'q"\\\n'), 2) == 'kvgate:test_info{a="q\\"\\\\\\n",b="x"} 2.0\n'
    for i in range(500):
        assert spec.sample_line((str(i), ""), i) == f'kvgate:test_info{{a="",b="{i}"}} {float(i)}\n'
    assert 0 < len(spec.prefixes) <= exposition.MAX_PREFIXES


def test_names_the_format_would_escape_are_refused():
    with pytest.raises(ValueError):
        FamilySpec("vllm:bad-name", "gauge", "x")
    with pytest.raises(ValueError):
        FamilySpec("vllm:ok", "gauge", "x", ("bad.label",))
    with pytest.raises(ValueError):
        FamilySpec("vllm:ok", "histogram", "x")
