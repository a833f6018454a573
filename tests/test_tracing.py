"""kvgate.common.tracing and the components' span builders: off means the SDK is never imported; the sampler is
parent-based; Envoy's tracer comes from the standard OTEL_* variables; the spans' parents and attributes."""

from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from kvgate.common import tracing
from kvgate.common.envoy_config import EnvoyTracing, add_tracing, tracing_from_env

sdk = pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

OTEL_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_SAMPLER",
             "OTEL_TRACES_SAMPLER_ARG", "OTEL_SERVICE_NAME", "OTEL_EXPORTER_OTLP_PROTOCOL",
             "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
SAMPLED_PARENT = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
UNSAMPLED_PARENT = "00-" + "3" * 32 + "-" + "4" * 16 + "-00"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OTEL_BSP_EXPORT_TIMEOUT", "500")  # a shutdown's export to the dead endpoint gives up soon


@pytest.fixture
def recorded(monkeypatch):
    """A setup() tracing (its OTLP endpoint a closed port) whose spans are also kept in memory: (tracing, spans)."""
    made = []

    def make(endpoint="http://127.0.0.1:9", component="kvgate-test"):
        t = tracing.setup(component, endpoint)
        memory = InMemorySpanExporter()
        t.provider.add_span_processor(SimpleSpanProcessor(memory))
        made.append(t)
        return t, memory

    yield make
    for t in made:
        t.shutdown()


@pytest.mark.processes
def test_disabled_tracing_imports_no_sdk():
    """No endpoint: setup is None, and the EPP's and the engine server's modules import no OpenTelemetry SDK."""
    code = ("import sys, os\n"
            "for k in list(os.environ):\n"
            "    k.startswith('OTEL_') and os.environ.pop(k)\n"
            "import kvgate.epp.server_assembly, kvgate.epp.extproc, kvgate.engine.server.app, kvgate.stack.local_stack\n"
            "from kvgate.common.tracing import setup\n"
            "assert setup('kvgate-epp') is None and setup('kvgate-engine', None) is None\n"
            "loaded = sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter')))\n"
            "print(loaded)\n"
            "assert not loaded, loaded\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_an_endpoint_turns_tracing_on_flag_first(monkeypatch):
    assert tracing.configured_endpoint() is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    assert tracing.configured_endpoint() == "http://collector:4317"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4317")
    assert tracing.configured_endpoint() == "http://traces:4317"
    assert tracing.configured_endpoint("http://flag:4317") == "http://flag:4317"


def test_only_otlp_grpc_is_exported(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    with pytest.raises(tracing.TracingConfigError, match="grpc"):
        tracing.setup("kvgate-test", "http://127.0.0.1:9")


def test_an_endpoint_without_the_sdk_is_a_one_line_start_error(monkeypatch):
    from kvgate.common.errors import ConfigError

    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # what an install without the SDK finds
    with pytest.raises(ConfigError, match="pip install opentelemetry-sdk"):
        tracing.setup("kvgate-test", "http://127.0.0.1:9")


def test_service_name_from_the_environment(monkeypatch, recorded):
    monkeypatch.setenv("OTEL_SERVICE_NAME", "pool-a-epp")
    t, _ = recorded(component="kvgate-epp")
    assert t.provider.resource.attributes["service.name"] == "pool-a-epp"
    monkeypatch.delenv("OTEL_SERVICE_NAME")
    t2, _ = recorded(component="kvgate-engine")
    assert t2.provider.resource.attributes["service.name"] == "kvgate-engine"


def _span_under(t, traceparent: str | None):
    context = tracing.extract({"traceparent": traceparent} if traceparent else {})
    span = t.tracer.start_span("probe", context=context)
    span.end()
    return span


def test_parent_based_ratio_sampling_follows_the_parent_and_samples_roots_by_ratio(monkeypatch, recorded):
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")
    t, memory = recorded()
    _span_under(t, SAMPLED_PARENT)  # a sampled parent wins over the ratio
    _span_under(t, UNSAMPLED_PARENT)
    for _ in range(20):
        _span_under(t, None)  # roots at ratio 0: never
    spans = memory.get_finished_spans()
    assert [s.context.trace_id for s in spans] == [int("1" * 32, 16)]
    assert spans[0].parent.span_id == int("2" * 16, 16)

    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "1")
    t2, memory2 = recorded()
    _span_under(t2, UNSAMPLED_PARENT)  # an unsampled parent wins over the ratio
    _span_under(t2, None)
    spans = memory2.get_finished_spans()
    assert len(spans) == 1 and spans[0].parent is None


def test_inject_names_the_span_as_parent(recorded):
    t, _ = recorded()
    span = t.tracer.start_span("parent", context=tracing.extract({"traceparent": SAMPLED_PARENT}))
    headers = tracing.inject(span)
    span.end()
    assert headers["traceparent"] == f"00-{'1' * 32}-{span.get_span_context().span_id:016x}-01"


def test_envoy_tracer_from_the_standard_variables():
    assert tracing_from_env({}) is None
    t = tracing_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel.monitoring:4317",
                          "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"})
    assert (t.host, t.port, t.sampling_percent) == ("otel.monitoring", 4317, 25.0)
    assert tracing_from_env({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "collector:4318",
                             "OTEL_TRACES_SAMPLER": "always_off"}).sampling_percent == 0.0
    with pytest.raises(ValueError, match="OTEL_TRACES_SAMPLER_ARG"):
        tracing_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_TRACES_SAMPLER": "traceidratio",
                          "OTEL_TRACES_SAMPLER_ARG": "lots"})
    with pytest.raises(ValueError, match="plaintext gRPC"):
        EnvoyTracing.from_endpoint("https://collector:4317")


def test_add_tracing_sets_every_hcm_and_adds_the_collector_cluster():
    hcm = {"@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                    "HttpConnectionManager"}
    bootstrap = {"static_resources": {"listeners": [{"filter_chains": [{"filters": [{"typed_config": hcm}]}]}],
                                      "clusters": [{"name": "x"}]}}
    assert add_tracing(bootstrap, None) == bootstrap and "tracing" not in hcm
    add_tracing(bootstrap, EnvoyTracing("c", 4317, 10.0))
    assert hcm["tracing"]["random_sampling"] == {"value": 10.0}
    assert hcm["tracing"]["provider"]["name"] == "envoy.tracers.opentelemetry"
    assert [c["name"] for c in bootstrap["static_resources"]["clusters"]] == ["x", "kvgate-otel-collector"]


def test_epp_span_prefers_envoy_s_grpc_metadata_over_the_request_header(recorded):
    from kvgate.epp.tracing import RequestSpan

    t, memory = recorded()
    envoy = "00-" + "5" * 32 + "-" + "6" * 16 + "-01"
    RequestSpan(t.tracer, [("traceparent", envoy), ("x-forwarded-for", "1.2.3.4")],
                {"traceparent": SAMPLED_PARENT, ":path": "/v1/completions?x=1", ":method": "POST"}).end()
    RequestSpan(t.tracer, (), {"traceparent": SAMPLED_PARENT}).end()
    first, second = memory.get_finished_spans()
    assert (first.context.trace_id, first.parent.span_id) == (int("5" * 32, 16), int("6" * 16, 16))
    assert first.attributes["url.path"] == "/v1/completions"
    assert (second.context.trace_id, second.parent.span_id) == (int("1" * 32, 16), int("2" * 16, 16))


def test_engine_span_has_genai_attributes_and_the_engine_timeline(recorded):
    from kvgate.engine.sampling_params import SamplingParams
    from kvgate.engine.server.tracing import RequestTrace

    t, memory = recorded()
    now = time.monotonic()
    trace = RequestTrace(t.tracer, {"traceparent": SAMPLED_PARENT}, "chat", "m",
                         SamplingParams(temperature=0.3, top_p=0.8, max_tokens=7))
    trace.response_id = "chatcmpl-1"
    trace.sample_finished("length", {"arrival_time": now - 0.5, "scheduled_time": now - 0.4,
                                     "first_token_time": now - 0.3, "finished_time": now - 0.1})
    tracker = SimpleNamespace(arrival=now - 0.5, first_token_time=now - 0.29, num_prompt_tokens=11, generated=7,
                              unfinished_samples=0)
    trace.end(tracker)
    spans = {s.name: s for s in memory.get_finished_spans()}
    assert set(spans) == {"llm_request", "llm_request.queue", "llm_request.prefill", "llm_request.decode"}
    root = spans["llm_request"]
    assert root.parent.span_id == int("2" * 16, 16)
    a = root.attributes
    assert (a["gen_ai.request.model"], a["gen_ai.operation.name"], a["gen_ai.response.id"]) == ("m", "chat",
                                                                                               "chatcmpl-1")
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"], a["gen_ai.request.max_tokens"]) == (
        11, 7, 7)
    assert a["gen_ai.request.temperature"] == pytest.approx(0.3) and a["gen_ai.request.top_p"] == pytest.approx(0.8)
    assert a["gen_ai.latency.time_in_queue"] == pytest.approx(0.1, abs=1e-6)
    assert a["gen_ai.latency.time_to_first_token"] == pytest.approx(0.21, abs=1e-6)
    assert list(a["gen_ai.response.finish_reasons"]) == ["length"]
    queue, prefill, decode = (spans[f"llm_request.{n}"] for n in ("queue", "prefill", "decode"))
    assert all(s.parent.span_id == root.context.span_id for s in (queue, prefill, decode))
    assert queue.end_time - queue.start_time == pytest.approx(0.1e9, rel=0.05)
    assert queue.end_time <= prefill.start_time + 1_000 and prefill.end_time <= decode.start_time + 1_000
    assert root.start_time <= queue.start_time + 1_000_000


def test_an_unfinished_request_s_span_is_an_error(recorded):
    from kvgate.engine.sampling_params import SamplingParams
    from kvgate.engine.server.tracing import RequestTrace

    t, memory = recorded()
    trace = RequestTrace(t.tracer, {}, "text_completion", "m", SamplingParams())
    trace.end(SimpleNamespace(arrival=time.monotonic(), first_token_time=None, num_prompt_tokens=3, generated=0,
                              unfinished_samples=1))
    (span,) = memory.get_finished_spans()
    assert span.status.status_code.name == "ERROR" and span.parent is None
    assert "gen_ai.latency.time_to_first_token" not in span.attributes


@pytest.mark.processes  # envoy --mode validate
def test_the_operator_gives_epp_pods_otel_env_and_gateways_envoy_s_tracer(tmp_path):
    import json

    from kvgate.common.gateway_routes import RouteRule, WeightedBackend, render_gateway_files, static_bootstrap
    from kvgate.common.envoy_config import PoolBackend, envoy_binary
    from kvgate.operator import pool as p
    from kvgate.operator.config import TraceExport

    pool = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": "demo", "namespace": "default", "uid": "u1"},
            "spec": {"selector": {"matchLabels": {"app": "x"}}, "targetPorts": [{"number": 8000}],
                     "endpointPickerRef": {"name": "demo-epp", "port": {"number": 9002}}}}

    def epp_env(tracing):
        objs = p.render_epp_objects(pool, "kvgate:test", p.DEFAULT_EPP_CONFIG, tracing=tracing)
        (deployment,) = [o for o in objs if o["kind"] == "Deployment"]
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        return {e["name"]: e["value"] for e in container["env"]}

    assert not any(k.startswith("OTEL_") for k in epp_env(None))
    export = TraceExport("http://otel.monitoring:4317", 0.1)
    env = epp_env(export)
    assert env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == "http://otel.monitoring:4317"
    assert (env["OTEL_TRACES_SAMPLER"], env["OTEL_TRACES_SAMPLER_ARG"]) == ("parentbased_traceidratio", "0.1")
    assert tracing_from_env(env).sampling_percent == pytest.approx(10.0)  # what the EPP's setup reads, Envoy alike

    rule = RouteRule("default/r/0", 8080, [WeightedBackend(PoolBackend("default-demo", "demo-epp", 9002, []))])
    files = render_gateway_files([rule], [8080], 9901, tracing=export.envoy())
    config = static_bootstrap(files)
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert hcm["tracing"]["random_sampling"]["value"] == pytest.approx(10.0)
    assert "kvgate-otel-collector" in {c["name"] for c in config["static_resources"]["clusters"]}
    path = tmp_path / "envoy.json"
    path.write_text(json.dumps(config))
    r = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_kvgate_up_traces_every_component_when_given_an_endpoint(monkeypatch):
    from kvgate.cli import build_parser
    from kvgate.stack.local_stack import StackSpec, _tracing_args, envoy_tracing
    from kvgate.stack.up import stack_spec

    spec = stack_spec(build_parser().parse_args(["up", "--otlp-traces-endpoint", "http://127.0.0.1:4317"]))
    assert _tracing_args(spec) == ["--otlp-traces-endpoint", "http://127.0.0.1:4317"]  # the EPPs and the engines
    assert (envoy_tracing(spec).host, envoy_tracing(spec).port, envoy_tracing(spec).sampling_percent) == (
        "127.0.0.1", 4317, 100.0)
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.5")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    assert envoy_tracing(spec).sampling_percent == 50.0 and envoy_tracing(spec).host == "127.0.0.1"
    off = StackSpec(1, "demo", "sim", "127.0.0.1", 8080)
    assert _tracing_args(off) == [] and envoy_tracing(off).host == "collector"  # the children read the variables
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT")
    assert envoy_tracing(off) is None
