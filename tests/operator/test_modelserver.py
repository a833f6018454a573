import copy
from pathlib import Path

import pytest

from kvgate.common.sizes import parse_bytes
from kvgate.operator import modelserver as m
from kvgate.operator.tenancy import TenantPolicy
from tests.operator.conftest import NOW

IMAGE = "kvgate:test"


def _serve_args(deployment):
    return deployment["spec"]["template"]["spec"]["containers"][0]["command"]


def test_sample_becomes_a_pool_member_deployment(samples):
    ms, pool = samples["ModelServer"], samples["InferencePool"]
    dep = m.desired_engine_deployment(ms, pool, IMAGE)
    spec, pod = dep["spec"], dep["spec"]["template"]["spec"]
    assert spec["selector"] == {"matchLabels": {"app": "demo-llm"}}
    assert spec["replicas"] == 2
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert all(labels[k] == v for k, v in spec["selector"]["matchLabels"].items())
    (c,) = pod["containers"]
    assert c["command"][:8] == ["kvgate", "serve", "demo", "--host", "0.0.0.0", "--port", "8000",
                                "--served-model-name"]
    assert ["--backend", "sim"] == c["command"][c["command"].index("--backend"):][:2]
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    for probe in ("startupProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe  # 503 unless serving
    assert c["livenessProbe"]["httpGet"] == {"path": "/live", "port": "http"}  # 503 only once the loop died
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert "grpc" not in c[probe] and "tcpSocket" not in c[probe]
    assert c["securityContext"]["readOnlyRootFilesystem"] and pod["securityContext"]["runAsNonRoot"]
    mounts = {v["mountPath"] for v in c["volumeMounts"]}
    assert {m.CACHE_DIR, "/tmp"} <= mounts
    assert {"name": "KVGATE_CACHE_DIR", "value": m.CACHE_DIR} in c["env"]
    assert dep["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
    (owner,) = dep["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("ModelServer", "demo-llm", "uid-demo-llm")


def test_engine_flags_parse_with_the_engine_parser(samples):
    import argparse

    from kvgate.engine.cli_args import add_engine_args, engine_config_from_args

    ms = copy.deepcopy(samples["ModelServer"])
    ms["spec"]["engine"] = {"backend": "torch", "blockSize": 32, "maxNumSeqs": 8, "maxNumBatchedTokens": 512,
                            "maxModelLen": 1024, "kvCacheMemory": "1.5Gi", "dtype": "bfloat16",
                            "enablePrefixCaching": False, "device": "cuda:1"}
    ms["spec"]["engine"].update(gpuMemoryUtilization=0.85, kvCacheDtype="fp8",
                                speculativeConfig={"numSpeculativeTokens": 4, "promptLookupMax": 3})
    ms["spec"]["extraArgs"] = ["--seed", "7"]
    command = _serve_args(m.desired_engine_deployment(ms, samples["InferencePool"], IMAGE))
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--shutdown-timeout", type=int)  # serve's own (test_serve_command_parses_...)
    add_engine_args(parser)
    args = parser.parse_args(command[2:])
    assert (args.block_size, args.max_num_seqs, args.max_num_batched_tokens, args.max_model_len) == (32, 8, 512, 1024)
    assert args.kv_cache_memory == parse_bytes("1.5GiB") and args.enable_prefix_caching is False
    assert (args.dtype, args.device, args.seed, args.served_model_name) == ("bfloat16", "cuda:1", 7, "demo")
    config = engine_config_from_args("/model", args)  # the engine's own checks of the rendered values
    assert (config.gpu_memory_utilization, config.kv_cache_dtype) == (0.85, "fp8")
    spec = config.speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == \
        ("ngram", 4, 3, 3)


@pytest.mark.parametrize("source,volume_key", [({"pvc": {"claimName": "models"}}, "persistentVolumeClaim"),
                                               ({"hostPath": {"path": "/data/q"}}, "hostPath"),
                                               ({"image": {"reference": "r/m:v1"}}, "image")])
def test_model_volume_mounted_read_only(samples, source, volume_key):
    ms = copy.deepcopy(samples["ModelServer"])
    ms["spec"]["model"] = {"path": "/models/q", "servedModelName": "q", **source}
    policy = TenantPolicy(allow_host_path=True)  # hostPath needs the operator's --allow-host-path
    pod = m.desired_engine_deployment(ms, samples["InferencePool"], IMAGE, policy)["spec"]["template"]["spec"]
    (vol,) = [v for v in pod["volumes"] if v["name"] == "model"]
    assert volume_key in vol
    (mount,) = [v for v in pod["containers"][0]["volumeMounts"] if v["name"] == "model"]
    assert mount == {"name": "model", "mountPath": "/models/q", "readOnly": True}
    assert pod["containers"][0]["command"][2] == "/models/q"


def test_pod_options(samples):
    ms = copy.deepcopy(samples["ModelServer"])
    ms["spec"].update(podLabels={"app": "demo-llm", "team": "a"}, nodeSelector={"gpu": "h100"},
                      tolerations=[{"key": "gpu", "operator": "Exists"}], image="custom:1",
                      resources={"limits": {"nvidia.com/gpu": 1}})
    dep = m.desired_engine_deployment(ms, samples["InferencePool"], IMAGE, TenantPolicy(image_prefixes=("custom",)))
    tpl = dep["spec"]["template"]
    assert tpl["metadata"]["labels"]["app"] == "demo-llm" and tpl["metadata"]["labels"]["team"] == "a"
    assert tpl["spec"]["nodeSelector"] == {"gpu": "h100"}
    assert tpl["spec"]["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    assert tpl["spec"]["containers"][0]["image"] == "custom:1"
    assert tpl["spec"]["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": 1}}


def test_idempotent(samples):
    a = m.desired_engine_deployment(samples["ModelServer"], samples["InferencePool"], IMAGE)
    b = m.desired_engine_deployment(copy.deepcopy(samples["ModelServer"]), samples["InferencePool"], IMAGE)
    assert a == b and repr(a) == repr(b)


@pytest.mark.parametrize("mutate,reason", [
    (lambda ms, pool: None, "PoolNotFound"),
    (lambda ms, pool: pool["spec"].update(targetPorts=[]), "PoolInvalid"),
    (lambda ms, pool: pool["spec"]["selector"].update(matchLabels={}), "PoolInvalid"),
    (lambda ms, pool: ms["spec"]["engine"].update(kvCacheMemory="lots"), "InvalidSpec"),
    (lambda ms, pool: ms["spec"]["model"].update(pvc={"claimName": "a"}, hostPath={"path": "/x"}, path="/m"),
     "InvalidSpec"),
    (lambda ms, pool: ms["spec"]["model"].update(pvc={"claimName": "a"}), "InvalidSpec"),  # path "demo"
    (lambda ms, pool: ms["spec"]["engine"].update(gpuMemoryUtilization=0), "InvalidSpec"),
    (lambda ms, pool: ms["spec"]["engine"].update(gpuMemoryUtilization=1.5), "InvalidSpec"),
    (lambda ms, pool: ms["spec"]["engine"].update(gpuMemoryUtilization="0.5"), "InvalidSpec"),
    (lambda ms, pool: ms["spec"]["engine"].update(gpuMemoryUtilization=float("nan")), "InvalidSpec"),
    (lambda ms, pool: ms["spec"]["engine"].update(speculativeConfig={"promptLookupMax": 3}), "InvalidSpec"),
    (lambda ms, pool: ms["spec"]["engine"].update(speculativeConfig={"numSpeculativeTokens": 64}), "InvalidSpec"),
    (lambda ms, pool: ms["spec"]["engine"].update(
        speculativeConfig={"numSpeculativeTokens": 4, "promptLookupMin": 5, "promptLookupMax": 3}), "InvalidSpec"),
])
def test_invalid_input_gives_conditions_not_exceptions(samples, mutate, reason):
    ms, pool = copy.deepcopy(samples["ModelServer"]), copy.deepcopy(samples["InferencePool"])
    missing = mutate(ms, pool) is None and reason == "PoolNotFound"
    pool = None if missing else pool
    assert m.validate_modelserver(ms, pool)[0]["reason"] == reason
    assert m.desired_engine_deployment(ms, pool, IMAGE) is None
    status = m.modelserver_status(ms, None, pool, now=NOW)
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and ready["reason"] == reason and ready["message"]


def test_status_counts_selector_and_conditions(samples):
    ms, pool = samples["ModelServer"], samples["InferencePool"]
    dep = m.desired_engine_deployment(ms, pool, IMAGE)
    dep["status"] = {"replicas": 2, "readyReplicas": 1}
    status = m.modelserver_status(ms, dep, pool, now=NOW)
    assert (status["replicas"], status["readyReplicas"], status["selector"]) == (2, 1, "app=demo-llm")
    assert status["observedGeneration"] == 1
    conds = {c["type"]: c for c in status["conditions"]}
    assert conds["Ready"]["reason"] == "ReplicasNotReady" and conds["PoolFound"]["status"] == "True"
    assert all(c["lastTransitionTime"] == NOW for c in status["conditions"])
    dep["status"]["readyReplicas"] = 2
    later = m.modelserver_status({**ms, "status": status}, dep, pool, now="2025-01-02T00:00:00Z")
    conds = {c["type"]: c for c in later["conditions"]}
    assert conds["Ready"]["reason"] == "AllReplicasReady" and conds["Ready"]["lastTransitionTime"] != NOW
    assert conds["PoolFound"]["lastTransitionTime"] == NOW  # unchanged status keeps its time
    assert m.is_ready(later)


def test_selector_change_needs_recreate(samples):
    ms, pool = samples["ModelServer"], copy.deepcopy(samples["InferencePool"])
    old = m.desired_engine_deployment(ms, pool, IMAGE)
    pool["spec"]["selector"]["matchLabels"] = {"app": "other"}
    new = m.desired_engine_deployment(ms, pool, IMAGE)
    assert m.needs_recreate(old, new) and not m.needs_recreate(new, new)


def test_kv_cache_bytes():
    assert m.kv_cache_bytes(1024) == 1024 and m.kv_cache_bytes("2Gi") == 2 * 1024 ** 3
    with pytest.raises(ValueError):
        m.kv_cache_bytes("2GB")


def test_engine_pods_are_locked_down(samples):
    """Non-root as the image's USER, no escalation, no capabilities, RuntimeDefault seccomp, no API token, no
    host namespaces, and only the operator's own volumes (emptyDirs) for the sample."""
    dep = m.desired_engine_deployment(samples["ModelServer"], samples["InferencePool"], IMAGE)
    pod = dep["spec"]["template"]["spec"]
    dockerfile = (Path(__file__).resolve().parents[2] / "Dockerfile").read_text()
    assert f"USER {m.RUN_AS}" in dockerfile  # the pods run as the image's own user
    assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": m.RUN_AS, "runAsGroup": m.RUN_AS,
                                      "fsGroup": m.RUN_AS, "seccompProfile": {"type": "RuntimeDefault"}}
    (c,) = pod["containers"]
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "runAsNonRoot": True, "privileged": False, "capabilities": {"drop": ["ALL"]}}
    assert pod["automountServiceAccountToken"] is False
    assert not {"hostNetwork", "hostPID", "hostIPC", "serviceAccountName"} & set(pod)
    assert all(set(v) == {"name", "emptyDir"} for v in pod["volumes"])


def test_user_structures_pass_only_known_fields(samples):
    """resources and tolerations are copied field by field: nothing the operator did not choose reaches the pod."""
    ms = copy.deepcopy(samples["ModelServer"])
    ms["spec"].update(resources={"limits": {"cpu": "1"}, "hostPath": "/"},
                      tolerations=[{"key": "k", "operator": "Exists", "privileged": True}])
    pod = m.desired_engine_deployment(ms, samples["InferencePool"], IMAGE)["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"] == {"limits": {"cpu": "1"}}
    assert pod["tolerations"] == [{"key": "k", "operator": "Exists"}]


def test_drain_grace_prestop_and_rollout(samples):
    ms = copy.deepcopy(samples["ModelServer"])
    dep = m.desired_engine_deployment(ms, samples["InferencePool"], IMAGE)
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    pod = dep["spec"]["template"]["spec"]
    command = pod["containers"][0]["command"]
    assert command[command.index("--shutdown-timeout") + 1] == "30"  # the default
    assert pod["terminationGracePeriodSeconds"] == 40  # grace + 10: the preStop sleep and a margin to exit
    assert pod["containers"][0]["lifecycle"] == {"preStop": {"exec": {"command": ["sleep", "5"]}}}
    ms["spec"]["engine"]["shutdownGracePeriodSeconds"] = 120
    pod = m.desired_engine_deployment(ms, samples["InferencePool"], IMAGE)["spec"]["template"]["spec"]
    command = pod["containers"][0]["command"]
    assert command[command.index("--shutdown-timeout") + 1] == "120"
    assert pod["terminationGracePeriodSeconds"] == 130
    # Liveness tolerates ~25 s of failing /health (a slow step) before a restart; the model load is the
    # startup probe's (liveness does not run before it succeeded).
    live = pod["containers"][0]["livenessProbe"]
    assert (live["failureThreshold"] - 1) * live["periodSeconds"] >= 25
    start = pod["containers"][0]["startupProbe"]
    assert start["failureThreshold"] * start["periodSeconds"] >= 1800


def test_serve_command_parses_with_the_real_kvgate_cli(samples):
    """The whole command, operator-set flags included, through `kvgate serve`'s own parser."""
    from kvgate.cli import build_parser

    ms = copy.deepcopy(samples["ModelServer"])
    ms["spec"]["engine"]["shutdownGracePeriodSeconds"] = 45
    command = _serve_args(m.desired_engine_deployment(ms, samples["InferencePool"], IMAGE))
    parser = build_parser()
    args = parser.parse_args(command[1:])
    assert (args.port, args.host, args.shutdown_timeout) == (8000, "0.0.0.0", 45)


@pytest.mark.parametrize("extra", [["--port", "9"], ["--host=127.0.0.1"], ["--shutdown-timeout", "999"]])
def test_extra_args_may_not_set_the_operators_flags(samples, extra):
    ms = copy.deepcopy(samples["ModelServer"])
    ms["spec"]["extraArgs"] = ["--seed", "1", *extra]
    (problem,) = m.validate_modelserver(ms, samples["InferencePool"])
    assert problem["reason"] == "InvalidSpec" and extra[0].split("=")[0] in problem["message"]
    assert m.desired_engine_deployment(ms, samples["InferencePool"], IMAGE) is None


def test_kv_events_render_engine_flag_ports_and_the_annotations_the_epp_reads(samples):
    """spec.engine.kvEvents → the engine's --kv-events-config (parsed by the engine's own parser), named container
    ports, and pod annotations from which the EPP's pod watch derives where to subscribe."""
    from kvgate.cli import build_parser
    from kvgate.engine.kv_events import KVEventsConfig
    from kvgate.epp.datastore import pool_endpoints
    from kvgate.epp.kv_events.sources import event_source

    ms, pool = copy.deepcopy(samples["ModelServer"]), samples["InferencePool"]
    assert "--kv-events-config" not in _serve_args(m.desired_engine_deployment(ms, pool, IMAGE))  # off unless asked
    ms["spec"]["engine"]["kvEvents"] = {"port": 5557, "replayPort": 5558}
    dep = m.desired_engine_deployment(ms, pool, IMAGE)
    args = build_parser().parse_args(_serve_args(dep)[1:])
    config = KVEventsConfig.from_json(args.kv_events_config)
    assert config.enabled and (config.endpoint, config.replay_endpoint) == ("tcp://*:5557", "tcp://*:5558")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert [(p["name"], p["containerPort"]) for p in c["ports"]] == [("http", 8000), ("kv-events", 5557),
                                                                      ("kv-replay", 5558)]
    template = dep["spec"]["template"]
    pod = {"metadata": {**template["metadata"], "name": "p0", "namespace": pool["metadata"].get("namespace", "")},
           "status": {"podIP": "10.0.0.7", "phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}
    (endpoint,) = pool_endpoints(pool, [pod])
    source = event_source(endpoint, None, None, "")
    assert (source.endpoint, source.replay_endpoint) == ("tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558")


@pytest.mark.parametrize("kv_events", [{"port": 8000}, {"port": 5557, "replayPort": 5557}, {"replayPort": 5558},
                                       {"port": 80}])
def test_kv_events_ports_that_clash_or_are_missing_are_a_condition(samples, kv_events):
    ms = copy.deepcopy(samples["ModelServer"])
    ms["spec"]["engine"]["kvEvents"] = kv_events
    problems = m.validate_modelserver(ms, samples["InferencePool"])
    assert [p["reason"] for p in problems] == ["InvalidSpec"] and "kvEvents" in problems[0]["message"], problems
    assert m.desired_engine_deployment(ms, samples["InferencePool"], IMAGE) is None


def _lora_sample():
    from tests.operator.conftest import REPO, load_docs

    docs = {d["kind"]: d for d in load_docs(REPO / "crds" / "samples" / "lora" / "lora.yaml")}
    for doc in docs.values():
        doc["metadata"].update(namespace="default", uid=f"uid-{doc['metadata']['name']}", generation=1)
    return docs


def test_lora_sample_renders_vllms_flags_and_a_read_only_adapters_volume():
    """spec.engine.lora → the engine's own flags (parsed by its own parser into its EngineConfig) and the adapters'
    volume, read-only at /adapters; the sample's InferenceModelRewrite splits its public name across them."""
    from kvgate.cli import build_parser
    from kvgate.engine.cli_args import engine_config_from_args
    from kvgate.epp.datastore import parse_rewrites

    docs = _lora_sample()
    ms, pool = docs["ModelServer"], docs["InferencePool"]
    assert m.validate_modelserver(ms, pool) == []
    dep = m.desired_engine_deployment(ms, pool, IMAGE)
    args = build_parser().parse_args(_serve_args(dep)[1:])
    config = engine_config_from_args(args.model, args)
    assert (config.enable_lora, config.max_loras, config.max_lora_rank) == (True, 2, 16)
    assert [(mod.name, mod.path) for mod in config.lora_modules] == [("support-v1", "/adapters/support-v1"),
                                                                      ("support-v2", "/adapters/support-v2")]
    pod = dep["spec"]["template"]["spec"]
    assert {"name": "lora-adapters", "persistentVolumeClaim": {"claimName": "qwen3-adapters", "readOnly": True}} \
        in pod["volumes"]
    assert {"name": "lora-adapters", "mountPath": "/adapters", "readOnly": True} in pod["containers"][0]["volumeMounts"]
    (rule,) = parse_rewrites([docs["InferenceModelRewrite"]], "lora-pool")
    assert rule.targets == [("support-v1", 70), ("support-v2", 30)]


@pytest.mark.parametrize("edit, says", [
    (lambda lora: lora["adapters"].append({"name": "support-v1", "path": "x"}), "unique"),
    (lambda lora: lora["adapters"].append({"name": "qwen3", "path": "x"}), "differ from the served model"),
    (lambda lora: lora["adapters"].append({"name": "-bad", "path": "x"}), "must match"),
    (lambda lora: lora["adapters"].append({"name": "up", "path": "../../etc"}), "inside the adapters volume"),
    (lambda lora: lora["adapters"].append({"name": "abs", "path": "/etc"}), "inside the adapters volume"),
    (lambda lora: lora["source"].update(image={"reference": "r"}), "exactly one adapter volume source"),
    (lambda lora: lora.pop("source") and lora.update(source={}), "exactly one adapter volume source"),
    (lambda lora: lora.update(maxCpuLoras=1), "maxCpuLoras (1) must be >= maxLoras (2)"),
])
def test_bad_lora_specs_are_a_condition_not_a_deployment(edit, says):
    docs = _lora_sample()
    ms, pool = docs["ModelServer"], docs["InferencePool"]
    edit(ms["spec"]["engine"]["lora"])
    problems = m.validate_modelserver(ms, pool)
    assert problems and problems[0]["reason"] == "InvalidSpec" and says in problems[0]["message"], problems
    assert m.desired_engine_deployment(ms, pool, IMAGE) is None


def test_lora_of_the_wrong_shape_is_a_condition():
    docs = _lora_sample()
    ms = docs["ModelServer"]
    ms["spec"]["engine"]["lora"]["adapters"] = [{"name": "x"}]  # no path
    problems = m.validate_modelserver(ms, docs["InferencePool"])
    assert problems[0]["reason"] == "InvalidSpec" and "spec.engine.lora.adapters[0].path" in problems[0]["message"]


API_KEY_REF = {"name": "llm-keys", "key": "token"}


def test_api_key_reaches_the_engine_from_the_secret_never_in_args(samples, monkeypatch):
    """spec.engine.apiKeySecretRef → VLLM_API_KEY from the Secret's key (resolved by the kubelet, in the pod's own
    namespace) and --require-api-key; the command, parsed and started by `kvgate serve`'s own code, requires
    exactly the Secret's value, and with an empty value it refuses to start (status 2) instead of serving open."""
    from kvgate.cli import build_parser, main
    from kvgate.engine.server.auth import resolve_api_keys

    ms, pool = copy.deepcopy(samples["ModelServer"]), samples["InferencePool"]
    (plain,) = m.desired_engine_deployment(ms, pool, IMAGE)["spec"]["template"]["spec"]["containers"]
    assert "VLLM_API_KEY" not in {e["name"] for e in plain["env"]} and "--require-api-key" not in plain["command"]
    ms["spec"]["engine"]["apiKeySecretRef"] = API_KEY_REF
    pod = m.desired_engine_deployment(ms, pool, IMAGE)["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    (env,) = [e for e in c["env"] if e["name"] == "VLLM_API_KEY"]
    assert env == {"name": "VLLM_API_KEY",
                   "valueFrom": {"secretKeyRef": {"name": "llm-keys", "key": "token", "optional": False}}}
    assert "args" not in c and not any("llm-keys" in a or "token" in a for a in c["command"])
    assert not any("secret" in v for v in pod["volumes"])  # the environment only: no Secret volume
    args = build_parser().parse_args(c["command"][1:])
    assert args.require_api_key and args.api_key is None
    assert resolve_api_keys(args.api_key, {"VLLM_API_KEY": "s3cret-value"}) == ["s3cret-value"]
    monkeypatch.setenv("VLLM_API_KEY", "")  # the Secret's key holds an empty value
    assert main(c["command"][1:]) == 2  # the pod's command, as `kvgate` runs it: its exit status


@pytest.mark.parametrize("ref, says", [
    ("llm-keys", "spec.engine.apiKeySecretRef: expected a mapping, got str"),
    ({"name": "llm-keys"}, "spec.engine.apiKeySecretRef.key: required"),
    ({"key": "token"}, "spec.engine.apiKeySecretRef.name: required"),
    ({"name": 7, "key": "token"}, "spec.engine.apiKeySecretRef.name: expected a string, got int"),
    ({"name": "LLM_Keys", "key": "token"}, "engine.apiKeySecretRef: name 'LLM_Keys' is not a Secret name"),
    ({"name": "llm-keys", "key": "../token"}, "engine.apiKeySecretRef: key '../token' is not a Secret key"),
    ({"name": "x" * 254, "key": "token"}, "is not a Secret name"),
])
def test_a_wrong_api_key_secret_ref_is_a_condition_not_a_deployment(samples, ref, says):
    ms, pool = copy.deepcopy(samples["ModelServer"]), samples["InferencePool"]
    ms["spec"]["engine"]["apiKeySecretRef"] = ref
    problems = m.validate_modelserver(ms, pool)
    assert [p["reason"] for p in problems] == ["InvalidSpec"] and says in problems[0]["message"], problems
    assert m.desired_engine_deployment(ms, pool, IMAGE) is None
    ready = next(c for c in m.modelserver_status(ms, None, pool, NOW)["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec") and says in ready["message"]


@pytest.mark.parametrize("extra", [["--api-key", "k"], ["--api-key=k"], ["--api", "k"], ["--api-key", "a", "b"]])
def test_extra_args_may_not_carry_an_api_key(samples, extra):
    """A key in extraArgs would sit in the ModelServer, the Deployment and the pods for anyone who reads them."""
    ms = copy.deepcopy(samples["ModelServer"])
    ms["spec"]["extraArgs"] = ["--seed", "1", *extra]
    (problem,) = m.validate_modelserver(ms, samples["InferencePool"])
    assert problem["reason"] == "InvalidSpec" and "apiKeySecretRef" in problem["message"], problem
    assert "k" not in problem["message"].split()  # the refusal does not repeat the key
    assert m.desired_engine_deployment(ms, samples["InferencePool"], IMAGE) is None
