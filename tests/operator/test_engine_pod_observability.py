"""What the engine pods carry for the observability pipeline: the standard OTEL_* variables when the operator is
started with --otlp-traces-endpoint (and vLLM's own --otlp-traces-endpoint flag, which it needs to trace at all,
checked by vLLM's parser where $KVGATE_VLLM_PYTHON names an interpreter with vLLM), nothing without it; and the
`kvgate.dev/pool` label naming the pool, which podLabels may not change."""

import copy
import json
import os
import subprocess
from pathlib import Path

import pytest

from kvgate.common import tracing
from kvgate.operator import modelserver as m, naming
from kvgate.operator.config import OperatorConfig, TraceExport
from kvgate.operator.reconciler import Reconciler
from kvgate.operator.tenancy import TenantPolicy
from tests.operator.memory_kube import MemoryKube

IMAGES = {"kvgate": "kvgate:test", "vllm": "vllm/vllm-openai:v0.32.0", "sglang": "lmsysorg/sglang:v0.5"}
COLLECTOR = "http://otel-collector.monitoring:4317"
VLLM_PYTHON = os.environ.get("KVGATE_VLLM_PYTHON", "")


def _ms(samples, kind: str, **spec) -> dict:
    ms = copy.deepcopy(samples["ModelServer"])
    ms["spec"]["engine"] = {"type": kind}
    ms["spec"].update(spec)
    return ms


def _container(dep: dict) -> dict:
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container["env"]}


@pytest.mark.parametrize("kind,service", [("kvgate", "kvgate-engine"), ("vllm", "vllm"), ("sglang", "sglang")])
def test_engines_get_the_otel_variables_when_tracing_is_configured(samples, kind, service):
    ms = _ms(samples, kind, extraArgs=["--seed", "7"])
    traced = m.desired_engine_deployment(ms, samples["InferencePool"], IMAGES, TenantPolicy(), [],
                                         TraceExport(COLLECTOR, 0.25))
    env = _env(_container(traced))
    assert {k: v for k, v in env.items() if k.startswith("OTEL_")} == {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": COLLECTOR, "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.25", "OTEL_SERVICE_NAME": service}
    command = _container(traced)["command"]
    if kind == "vllm":  # vLLM exports spans only with its flag (the OTEL_* variables then pick sampler and name)
        assert command[-4:] == ["--otlp-traces-endpoint", COLLECTOR, "--seed", "7"]
    else:
        assert "--otlp-traces-endpoint" not in command
    untraced = m.desired_engine_deployment(ms, samples["InferencePool"], IMAGES, TenantPolicy(), [])
    assert not [k for k in _env(_container(untraced)) if k.startswith("OTEL_")]
    assert "--otlp-traces-endpoint" not in _container(untraced)["command"]


def test_the_kvgate_engine_reads_the_rendered_variables(samples, monkeypatch):
    """kvgate serve's tracing (kvgate.common.tracing, which engine/server/tracing.py uses) finds the collector in
    exactly the environment the operator renders."""
    dep = m.desired_engine_deployment(_ms(samples, "kvgate"), samples["InferencePool"], IMAGES, TenantPolicy(), [],
                                      TraceExport(COLLECTOR))
    for name in tracing.ENDPOINT_ENV:
        monkeypatch.delenv(name, raising=False)
    assert tracing.configured_endpoint() is None
    for name, value in _env(_container(dep)).items():
        if name.startswith("OTEL_"):
            monkeypatch.setenv(name, value)
    assert tracing.configured_endpoint() == COLLECTOR


def test_the_reconciler_passes_the_operators_trace_export_to_the_engines(samples):
    kube = MemoryKube()
    ms = _ms(samples, "vllm")
    for obj in (samples["InferencePool"], ms):
        kube.put(obj)
    config = OperatorConfig("kvgate:test", "kvgate:test", "envoy:test", vllm_image=IMAGES["vllm"],
                            tracing=TraceExport(COLLECTOR))
    Reconciler(kube, config).reconcile_modelserver("default", naming.name_of(ms))
    container = _container(kube.stored("Deployment", naming.engine_deployment_name(ms)))
    assert _env(container)["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == COLLECTOR
    assert container["command"][-2:] == ["--otlp-traces-endpoint", COLLECTOR]


@pytest.mark.processes
@pytest.mark.skipif(not Path(VLLM_PYTHON).is_file(), reason="$KVGATE_VLLM_PYTHON names no interpreter with vLLM")
def test_vllms_parser_takes_the_trace_flag(samples):
    """vLLM's own serve parser and observability config accept the rendered flag (its validator also checks
    that OpenTelemetry is importable in that interpreter, as it is in vLLM's images)."""
    dep = m.desired_engine_deployment(_ms(samples, "vllm"), samples["InferencePool"], IMAGES, TenantPolicy(), [],
                                      TraceExport(COLLECTOR))
    script = ("import json, sys\n"
              "from vllm.engine.arg_utils import AsyncEngineArgs\n"
              "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
              "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
              "args = make_arg_parser(FlexibleArgumentParser()).parse_args(json.loads(sys.stdin.read()))\n"
              "from vllm.config import ObservabilityConfig\n"
              "config = ObservabilityConfig(otlp_traces_endpoint=args.otlp_traces_endpoint)\n"
              "print('PARSED ' + json.dumps(config.otlp_traces_endpoint))\n")
    proc = subprocess.run([VLLM_PYTHON, "-c", script], input=json.dumps(_container(dep)["command"][2:]),
                          capture_output=True, text=True, timeout=300, cwd="/")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("PARSED ")]
    assert json.loads(line[len("PARSED "):]) == COLLECTOR


@pytest.mark.parametrize("kind", ["kvgate", "vllm", "sglang"])
def test_engine_pods_carry_their_pools_name(samples, kind):
    pool = samples["InferencePool"]
    dep = m.desired_engine_deployment(_ms(samples, kind), pool, IMAGES, TenantPolicy(), [])
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert labels[naming.POOL_LABEL] == naming.name_of(pool)
    # not part of the Deployment's selector (the pool's selector alone is: a pool rename keeps its pods' selector)
    assert naming.POOL_LABEL not in dep["spec"]["selector"]["matchLabels"]


def test_the_pool_label_is_a_label_value_and_podlabels_may_not_change_it(samples):
    pool = copy.deepcopy(samples["InferencePool"])
    pool["metadata"]["name"] = "p" * 100
    value = naming.pool_label(pool)[naming.POOL_LABEL]
    assert len(value) <= 63 and value.startswith("p") and value[-1].isalnum()
    ms = _ms(samples, "kvgate", podLabels={naming.POOL_LABEL: "another-pool"})
    problems = m.validate_modelserver(ms, samples["InferencePool"], TenantPolicy(), [], IMAGES)
    assert [p["reason"] for p in problems] == ["ReservedLabel"] and naming.POOL_LABEL in problems[0]["message"]
