"""ModelServer spec.engine.type (kvgate, vllm, sglang): each engine's command line from the same fields, parsed
by vLLM's own `vllm serve` parser where $KVGATE_VLLM_PYTHON names an interpreter with vLLM (docs/benchmarks.md)
and, for SGLang (not installable here), by a parser built from the flag names and kinds read in SGLang's
python/sglang/srt/server_args.py (ServerArgs; flags spelled from its field names); the pod around each engine
(image, non-root caches, probes, GPUs, the engine-type label the EPP reads its metrics by); what an engine cannot
take, as conditions."""

import argparse
import copy
import json
import os
import subprocess
from pathlib import Path

import pytest

from kvgate.common.epp_protocol import ENGINE_TYPE_LABEL
from kvgate.epp.datalayer import DIALECTS, dialect_for
from kvgate.epp.datalayer.exposition import parse_metrics
from kvgate.epp.datastore import pool_endpoints
from kvgate.operator import modelserver as m, naming
from kvgate.operator.config import OperatorConfig
from kvgate.operator.main import add_operator_parser
from kvgate.operator.reconciler import Reconciler
from kvgate.operator.tenancy import TenantPolicy, privileged_uses
from tests.operator.conftest import REPO, load_docs
from tests.operator.memory_kube import MemoryKube

IMAGE = "kvgate:test"
VLLM_IMAGE = "vllm/vllm-openai:v0.32.0"
SGLANG_IMAGE = "lmsysorg/sglang:v0.5"
IMAGES = {"kvgate": IMAGE, "vllm": VLLM_IMAGE, "sglang": SGLANG_IMAGE}
VLLM_PYTHON = os.environ.get("KVGATE_VLLM_PYTHON", "")

# Every field with a flag in all three engines; lora and kvEvents with the volume and ports they need.
COMMON_ENGINE = {"tensorParallelSize": 2, "maxModelLen": 4096, "blockSize": 32, "enablePrefixCaching": False,
                 "maxNumSeqs": 64, "maxNumBatchedTokens": 2048, "gpuMemoryUtilization": 0.85,
                 "kvCacheDtype": "fp8", "quantization": "fp8", "dtype": "bfloat16",
                 "kvEvents": {"port": 5557, "replayPort": 5558},
                 "lora": {"maxLoras": 2, "maxLoraRank": 16, "maxCpuLoras": 4,
                          "adapters": [{"name": "sql", "path": "sql-lora"}, {"name": "chat", "path": "chat/"}],
                          "source": {"pvc": {"claimName": "adapters"}}}}
MODEL = {"path": "/models/qwen3", "servedModelName": "qwen3", "pvc": {"claimName": "models"}}


def _ms(samples, engine, **spec):
    ms = copy.deepcopy(samples["ModelServer"])
    ms["spec"]["engine"] = engine
    ms["spec"]["model"] = dict(MODEL)
    ms["spec"].update(spec)
    return ms


def _render(samples, engine, images=IMAGES, policy=TenantPolicy(), **spec):
    ms = _ms(samples, engine, **spec)
    return ms, m.desired_engine_deployment(ms, samples["InferencePool"], images, policy)


def _problems(samples, engine, images=IMAGES, **spec):
    return [p["message"] for p in m.validate_modelserver(_ms(samples, engine, **spec), samples["InferencePool"],
                                                          TenantPolicy(), [], images)]


def _container(dep):
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


def _port(samples):
    return m.pool_port(samples["InferencePool"])


# --- vLLM: the rendered command through vLLM's own parser ----------------------------------------------------

# Runs under $KVGATE_VLLM_PYTHON: parses each argv (after `vllm serve`) with vLLM's serve parser, runs its checks of
# the parsed args, builds its engine args from them (which parses the JSON configs into vLLM's config classes), and
# prints what the engine would be configured with.
VLLM_PARSE = r"""
import json, sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser

out = []
for argv in json.loads(sys.stdin.read()):
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    validate_parsed_serve_args(args)
    engine = AsyncEngineArgs.from_cli_args(args)
    kv = engine.kv_events_config
    out.append({
        "model": args.model_tag, "host": args.host, "port": args.port, "shutdown_timeout": args.shutdown_timeout,
        "served_model_name": engine.served_model_name, "tensor_parallel_size": engine.tensor_parallel_size,
        "max_model_len": engine.max_model_len, "block_size": engine.block_size,
        "enable_prefix_caching": engine.enable_prefix_caching, "max_num_seqs": engine.max_num_seqs,
        "max_num_batched_tokens": engine.max_num_batched_tokens,
        "gpu_memory_utilization": engine.gpu_memory_utilization, "kv_cache_dtype": engine.kv_cache_dtype,
        "quantization": engine.quantization, "dtype": engine.dtype,
        "kv_cache_memory_bytes": engine.kv_cache_memory_bytes, "speculative_config": engine.speculative_config,
        "kv_events": None if kv is None else [kv.enable_kv_cache_events, kv.publisher, kv.endpoint,
                                              kv.replay_endpoint],
        "enable_lora": engine.enable_lora, "max_loras": engine.max_loras, "max_lora_rank": engine.max_lora_rank,
        "max_cpu_loras": engine.max_cpu_loras,
        "lora_modules": [[lm.name, lm.path] for lm in args.lora_modules or []],
        "seed": engine.seed,
    })
print("PARSED " + json.dumps(out))
"""


def _vllm_specs():
    return {
        "full": {"type": "vllm", **COMMON_ENGINE, "kvCacheMemory": "2Gi", "shutdownGracePeriodSeconds": 45,
                 "speculativeConfig": {"numSpeculativeTokens": 4, "promptLookupMax": 5},
                 "apiKeySecretRef": {"name": "llm-keys", "key": "api-key"}},
        "minimal": {"type": "vllm"},
    }


@pytest.fixture(scope="module")
def vllm_parsed():
    """name -> (rendered command, what vLLM's parser made of it), for each spec of _vllm_specs."""
    if not Path(VLLM_PYTHON).is_file():
        pytest.skip("$KVGATE_VLLM_PYTHON names no interpreter with vLLM")
    samples = {}
    for path in sorted((REPO / "crds" / "samples").glob("*.yaml")):
        samples.update({doc["kind"]: doc for doc in load_docs(path)})
    commands = {name: _container(_render(samples, engine, extraArgs=["--seed", "7"])[1])["command"]
                for name, engine in _vllm_specs().items()}
    for command in commands.values():
        assert command[:2] == ["vllm", "serve"]
    proc = subprocess.run([VLLM_PYTHON, "-c", VLLM_PARSE], input=json.dumps([c[2:] for c in commands.values()]),
                          capture_output=True, text=True, timeout=300, cwd="/")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("PARSED ")]
    return dict(zip(commands, zip(commands.values(), json.loads(line[len("PARSED "):]))))


@pytest.mark.processes
def test_vllm_parses_every_field_as_the_spec_means_it(vllm_parsed, samples):
    command, parsed = vllm_parsed["full"]
    assert parsed == {
        "model": "/models/qwen3", "host": "0.0.0.0", "port": _port(samples), "shutdown_timeout": 45,
        "served_model_name": ["qwen3"], "tensor_parallel_size": 2, "max_model_len": 4096, "block_size": 32,
        "enable_prefix_caching": False, "max_num_seqs": 64, "max_num_batched_tokens": 2048,
        "gpu_memory_utilization": 0.85, "kv_cache_dtype": "fp8", "quantization": "fp8", "dtype": "bfloat16",
        "kv_cache_memory_bytes": 2 * 1024 ** 3,
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5},
        "kv_events": [True, "zmq", "tcp://*:5557", "tcp://*:5558"],
        "enable_lora": True, "max_loras": 2, "max_lora_rank": 16, "max_cpu_loras": 4,
        "lora_modules": [["sql", "/adapters/sql-lora"], ["chat", "/adapters/chat"]],
        "seed": 7,  # extraArgs, last
    }
    # kvgate's own flags never reach vLLM (its parser would refuse them; checked here by name too)
    assert not {"--backend", "--device", "--kv-cache-memory", "--require-api-key", "--api-key"} & set(command)


@pytest.mark.processes
def test_vllm_minimal_spec_keeps_vllms_defaults(vllm_parsed, samples):
    command, parsed = vllm_parsed["minimal"]
    assert command == ["vllm", "serve", "/models/qwen3", "--host", "0.0.0.0", "--port",
                       str(_port(samples)), "--served-model-name", "qwen3", "--shutdown-timeout", "30", "--seed", "7"]
    assert parsed["kv_events"] is None and not parsed["enable_lora"] and parsed["tensor_parallel_size"] == 1


# --- SGLang: the rendered command through a parser of its flags ----------------------------------------------

def sglang_parser() -> argparse.ArgumentParser:
    """The flags the operator renders for SGLang, with the kind ServerArgs gives each (a bool field is a
    store_true flag; lora_paths takes several values; the rest one). allow_abbrev off: a misspelt flag fails."""
    p = argparse.ArgumentParser(allow_abbrev=False)
    for flag in ("--model-path", "--host", "--served-model-name", "--device", "--dtype", "--kv-cache-dtype",
                 "--quantization", "--kv-events-config"):
        p.add_argument(flag)
    for flag in ("--port", "--tp-size", "--context-length", "--page-size", "--max-running-requests",
                 "--chunked-prefill-size", "--max-loras-per-batch", "--max-lora-rank", "--max-loaded-loras"):
        p.add_argument(flag, type=int)
    p.add_argument("--mem-fraction-static", type=float)
    for flag in ("--enable-metrics", "--enable-lora", "--disable-radix-cache"):
        p.add_argument(flag, action="store_true")
    p.add_argument("--lora-paths", nargs="*")
    return p


def test_sglang_command_from_every_field(samples):
    _, dep = _render(samples, {"type": "sglang", **COMMON_ENGINE})
    command = _container(dep)["command"]
    assert command[:3] == ["python3", "-m", "sglang.launch_server"]
    args = sglang_parser().parse_args(command[3:])
    assert vars(args) == {
        "model_path": "/models/qwen3", "host": "0.0.0.0", "port": _port(samples), "served_model_name": "qwen3",
        "device": None, "dtype": "bfloat16", "kv_cache_dtype": "fp8_e4m3", "quantization": "fp8",
        "tp_size": 2, "context_length": 4096, "page_size": 32, "max_running_requests": 64,
        "chunked_prefill_size": 2048, "mem_fraction_static": 0.85, "enable_metrics": True,
        "disable_radix_cache": True, "enable_lora": True, "max_loras_per_batch": 2, "max_lora_rank": 16,
        "max_loaded_loras": 4, "lora_paths": ["sql=/adapters/sql-lora", "chat=/adapters/chat"],
        # SGLang's KVEventsConfig: publishing is on when the flag is given (no enable key)
        "kv_events_config": json.dumps({"publisher": "zmq", "endpoint": "tcp://*:5557",
                                        "replay_endpoint": "tcp://*:5558"}, separators=(",", ":")),
    }


def test_sglang_minimal_command_and_prefix_caching_on(samples):
    _, dep = _render(samples, {"type": "sglang", "enablePrefixCaching": True, "device": "cpu"})
    command = _container(dep)["command"]
    args = sglang_parser().parse_args(command[3:])
    assert args.device == "cpu" and not args.disable_radix_cache and args.enable_metrics
    assert "--shutdown-timeout" not in command  # SGLang has no drain flag: the preStop pause and grace only


# --- the pod around each engine ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_vllm_and_sglang_pods_run_non_root_with_writable_caches(samples, kind):
    _, dep = _render(samples, {"type": kind})
    pod = dep["spec"]["template"]["spec"]
    c = _container(dep)
    assert c["image"] == IMAGES[kind]
    assert pod["securityContext"]["runAsUser"] == m.RUN_AS and pod["securityContext"]["runAsNonRoot"]
    assert c["securityContext"]["readOnlyRootFilesystem"] and c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    env = {e["name"]: e.get("value") for e in c["env"]}
    writable = [v["mountPath"] for v in c["volumeMounts"] if not v.get("readOnly")]
    for var in ("HOME", "XDG_CACHE_HOME", "HF_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        assert any(env[var] == d or env[var].startswith(d + "/") for d in writable), var
    assert env["USER"]  # torch's compile cache asks getpass for a user name; uid 10001 has no passwd entry
    if kind == "vllm":
        assert env["VLLM_CACHE_ROOT"].startswith(m.CACHE_DIR) and env["VLLM_NO_USAGE_STATS"] == "1"
    # no /live in vLLM or SGLang: liveness is /health, after the startup probe's long allowance
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["startupProbe"]["httpGet"]["path"] == "/health"
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= m.STARTUP_LIMIT_S
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(m.PRE_STOP_SLEEP_S)]


def test_kvgate_pods_are_unchanged_by_the_engine_type(samples):
    ms, dep = _render(samples, {"backend": "sim"})
    _, typed = _render(samples, {"type": "kvgate", "backend": "sim"})
    assert dep == typed
    c = _container(dep)
    assert c["command"][:2] == ["kvgate", "serve"] and c["livenessProbe"]["httpGet"]["path"] == "/live"
    assert ENGINE_TYPE_LABEL not in dep["spec"]["template"]["metadata"]["labels"]
    assert "USER" not in {e["name"] for e in c["env"]}


@pytest.mark.parametrize("kind", ["kvgate", "vllm", "sglang"])
def test_every_engine_type_requests_a_gpu_a_rank_with_shared_memory(samples, kind):
    engine = {"type": kind, "tensorParallelSize": 4, **({"device": "cuda"} if kind != "vllm" else {})}
    _, dep = _render(samples, engine, resources={"limits": {"memory": "64Gi"}})
    c = _container(dep)
    assert c["resources"]["limits"] == {"memory": "64Gi", m.GPU_RESOURCE: "4"}
    assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]


def test_a_cpu_vllm_image_with_several_ranks_requests_no_gpus(samples):
    _, dep = _render(samples, {"type": "vllm", "device": "cpu", "tensorParallelSize": 2})
    c = _container(dep)
    assert m.GPU_RESOURCE not in (c.get("resources") or {}).get("limits", {})
    assert "--device" not in c["command"] and c["command"][c["command"].index("--tensor-parallel-size") + 1] == "2"


def test_vllm_gets_the_api_key_from_the_secret_in_its_environment(samples):
    _, dep = _render(samples, {"type": "vllm", "apiKeySecretRef": {"name": "llm-keys", "key": "api-key"}})
    c = _container(dep)
    (key,) = [e for e in c["env"] if e["name"] == m.API_KEY_ENV]
    assert key["valueFrom"]["secretKeyRef"] == {"name": "llm-keys", "key": "api-key", "optional": False}
    assert not any("api-key" in a for a in c["command"])


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_pods_carry_the_engine_type_the_epp_reads_their_metrics_by(samples, kind):
    _, dep = _render(samples, {"type": kind, "kvEvents": {"port": 5557}})
    template = dep["spec"]["template"]
    assert template["metadata"]["labels"][ENGINE_TYPE_LABEL] == kind
    assert template["metadata"]["annotations"]["kvgate.dev/kv-events-port"] == "5557"
    # The EPP's pod watch turns the pod into an endpoint whose dialect is that engine's.
    pod = {"metadata": {"name": "p", "namespace": "default", "labels": template["metadata"]["labels"]},
           "status": {"podIP": "10.0.0.9", "phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}
    (endpoint,) = pool_endpoints(samples["InferencePool"], [pod])
    assert dialect_for(endpoint.engine_type) is DIALECTS[kind]


def test_an_sglang_page_is_read_with_sglangs_names(samples):
    _, dep = _render(samples, {"type": "sglang"})
    dialect = dialect_for(dep["spec"]["template"]["metadata"]["labels"][ENGINE_TYPE_LABEL])
    page = ('# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{model_name="qwen3"} 5.0\n'
            '# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs{model_name="qwen3"} 3.0\n'
            '# TYPE sglang:token_usage gauge\nsglang:token_usage{model_name="qwen3"} 0.25\n'
            '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 99.0\n')
    metrics = parse_metrics(page, dialect)
    assert (metrics.running_requests, metrics.waiting_queue_size, metrics.kv_cache_usage) == (5, 3, 0.25)


# --- images -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_without_an_operator_image_the_modelserver_must_name_one(samples, kind):
    (problem,) = _problems(samples, {"type": kind}, images={"kvgate": IMAGE})
    assert f"engine.type {kind} needs a {kind} image" in problem and f"--{kind}-image" in problem
    # a named image must still be allowed
    ms = _ms(samples, {"type": kind}, image="registry.example/vllm:1")
    problems = m.validate_modelserver(ms, samples["InferencePool"], TenantPolicy(), [], {"kvgate": IMAGE})
    assert [p["reason"] for p in problems] == ["ImageNotAllowed"]
    dep = m.desired_engine_deployment(ms, samples["InferencePool"], IMAGE,
                                      TenantPolicy(image_prefixes=("registry.example",)))
    assert _container(dep)["image"] == "registry.example/vllm:1"


def test_the_operator_image_of_the_type_needs_no_prefix_and_others_do(samples):
    ms = _ms(samples, {"type": "vllm"}, image=VLLM_IMAGE)
    assert m.validate_modelserver(ms, samples["InferencePool"], TenantPolicy(), [], IMAGES) == []
    assert privileged_uses(ms, IMAGES["vllm"]) == []
    ms["spec"]["image"] = IMAGE  # the kvgate image is not vllm's
    assert [p["reason"] for p in m.validate_modelserver(ms, samples["InferencePool"], TenantPolicy(), [],
                                                       IMAGES)] == ["ImageNotAllowed"]


def test_operator_flags_name_the_engine_images():
    parser = argparse.ArgumentParser()
    args = add_operator_parser(parser.add_subparsers()).parse_args(["--vllm-image", VLLM_IMAGE])
    config = OperatorConfig(engine_image=args.engine_image, epp_image="e", envoy_image="v",
                            vllm_image=args.vllm_image, sglang_image=args.sglang_image)
    assert config.engine_images() == {"kvgate": args.engine_image, "vllm": VLLM_IMAGE}


# --- what an engine cannot take ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, engine, says", [
    ("vllm", {"backend": "sim"}, "backend is the kvgate engine's own (torch or sim); vllm has no such setting"),
    ("sglang", {"backend": "torch"}, "sglang has no such setting"),
    ("vllm", {"device": "cuda:1"}, "device 'cuda:1': vLLM runs on the platform its build"),
    ("sglang", {"device": "cuda:1"}, "SGLang takes a device kind"),
    ("vllm", {"kvCacheDtype": "int8"}, "kvCacheDtype 'int8': vLLM's --kv-cache-dtype takes"),
    ("sglang", {"kvCacheDtype": "int8"}, "kvCacheDtype 'int8': SGLang's --kv-cache-dtype takes"),
    ("sglang", {"kvCacheMemory": "2Gi"}, "kvCacheMemory: SGLang sizes its KV pool"),
    ("sglang", {"speculativeConfig": {"numSpeculativeTokens": 3}}, "speculativeConfig: prompt lookup"),
    ("sglang", {"apiKeySecretRef": {"name": "k", "key": "k"}}, "apiKeySecretRef: SGLang reads its key only"),
])
def test_fields_the_engine_lacks_are_conditions_naming_field_and_engine(samples, kind, engine, says):
    ms, dep = _render(samples, {"type": kind, **engine})
    assert dep is None
    problems = m.validate_modelserver(ms, samples["InferencePool"], TenantPolicy(), [], IMAGES)
    assert [p["reason"] for p in problems] == ["InvalidSpec"]
    assert problems[0]["message"].startswith("engine: ") and says in problems[0]["message"]
    status = m.modelserver_status(ms, None, samples["InferencePool"], problems=problems)
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and says in ready["message"]


@pytest.mark.parametrize("kind, extra, says", [
    ("sglang", ["--tp-size", "2"], "--tp-size (set engine.tensorParallelSize)"),
    ("sglang", ["--tp", "2"], "--tp-size (set engine.tensorParallelSize)"),  # argparse takes a prefix
    ("sglang", ["--model-path", "/other"], "extraArgs may not set --model-path"),
    ("sglang", ["--api-key", "sk-1"], "extraArgs may not set --api-key"),
    ("vllm", ["--shutdown-timeout", "5"], "extraArgs may not set --shutdown-timeout"),
    ("vllm", ["--tensor-parallel-size=2"], "--tensor-parallel-size (set engine.tensorParallelSize)"),
])
def test_extra_args_may_not_set_what_the_operator_or_a_field_sets(samples, kind, extra, says):
    problems = _problems(samples, {"type": kind}, extraArgs=extra)
    assert any(says in p for p in problems), problems


def test_an_unknown_type_and_the_engine_type_label_in_pod_labels_are_refused(samples):
    assert any("type 'tgi' is not one of kvgate, vllm, sglang" in p for p in _problems(samples, {"type": "tgi"}))
    problems = _problems(samples, {"type": "vllm"}, podLabels={ENGINE_TYPE_LABEL: "sglang"})
    assert any(f"podLabels may not set {ENGINE_TYPE_LABEL}" in p for p in problems)
    assert any("spec.engine.type: expected a string" in p for p in _problems(samples, {"type": 3}))


def test_the_reconciler_runs_a_vllm_modelserver_with_the_operators_vllm_image(samples):
    kube = MemoryKube()
    ms = _ms(samples, {"type": "vllm"})
    for obj in (samples["InferencePool"], ms):
        kube.put(obj)
    reconciler = Reconciler(kube, OperatorConfig(IMAGE, IMAGE, "envoy:test"))
    reconciler.reconcile_modelserver("default", naming.name_of(ms))  # no --vllm-image: a condition, no Deployment
    assert kube.stored("Deployment", naming.engine_deployment_name(ms)) is None
    ready = next(c for c in kube.stored("ModelServer", naming.name_of(ms))["status"]["conditions"]
                 if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec") and "--vllm-image" in ready["message"]
    reconciler = Reconciler(kube, OperatorConfig(IMAGE, IMAGE, "envoy:test", vllm_image=VLLM_IMAGE))
    reconciler.reconcile_modelserver("default", naming.name_of(ms))
    dep = kube.stored("Deployment", naming.engine_deployment_name(ms))
    assert _container(dep)["image"] == VLLM_IMAGE and _container(dep)["command"][:2] == ["vllm", "serve"]


def test_the_engine_samples_render_with_the_operators_images():
    docs = load_docs(REPO / "crds" / "samples" / "engines" / "engines.yaml")
    for doc in docs:
        doc["metadata"]["namespace"] = "default"
    pools = {d["metadata"]["name"]: d for d in docs if d["kind"] == "InferencePool"}
    for ms in (d for d in docs if d["kind"] == "ModelServer"):
        pool = pools[ms["spec"]["poolRef"]["name"]]
        dep = m.desired_engine_deployment(ms, pool, IMAGES, TenantPolicy(), list(pools.values()))
        kind = ms["spec"]["engine"]["type"]
        assert dep is not None, m.validate_modelserver(ms, pool, TenantPolicy(), list(pools.values()), IMAGES)
        assert _container(dep)["image"] == IMAGES[kind]
        assert dep["spec"]["template"]["metadata"]["labels"][ENGINE_TYPE_LABEL] == kind
