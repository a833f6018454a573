import copy

import pytest

from kvgate.engine.cli_args import parse_bytes
from kvgate.operator import modelserver as m
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
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert "tcpSocket" in c["livenessProbe"]
    assert not any("grpc" in probe for probe in (c["readinessProbe"], c["livenessProbe"]))
    assert c["securityContext"]["readOnlyRootFilesystem"] and pod["securityContext"]["runAsNonRoot"]
    mounts = {v["mountPath"] for v in c["volumeMounts"]}
    assert {m.CACHE_DIR, "/tmp"} <= mounts
    assert {"name": "KVGATE_CACHE_DIR", "value": m.CACHE_DIR} in c["env"]
    assert dep["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
    (owner,) = dep["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("ModelServer", "demo-llm", "uid-demo-llm")


def test_engine_flags_parse_with_the_engine_parser(samples):
    import argparse

    from kvgate.engine.cli_args import add_engine_args

    ms = copy.deepcopy(samples["ModelServer"])
    ms["spec"]["engine"] = {"backend": "torch", "blockSize": 32, "maxNumSeqs": 8, "maxNumBatchedTokens": 512,
                            "maxModelLen": 1024, "kvCacheMemory": "1.5Gi", "dtype": "bfloat16",
                            "enablePrefixCaching": False, "device": "cuda:1"}
    ms["spec"]["extraArgs"] = ["--seed", "7"]
    command = _serve_args(m.desired_engine_deployment(ms, samples["InferencePool"], IMAGE))
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    add_engine_args(parser)
    args = parser.parse_args(command[2:])
    assert (args.block_size, args.max_num_seqs, args.max_num_batched_tokens, args.max_model_len) == (32, 8, 512, 1024)
    assert args.kv_cache_memory == parse_bytes("1.5GiB") and args.enable_prefix_caching is False
    assert (args.dtype, args.device, args.seed, args.served_model_name) == ("bfloat16", "cuda:1", 7, "demo")


@pytest.mark.parametrize("source,volume_key", [({"pvc": {"claimName": "models"}}, "persistentVolumeClaim"),
                                               ({"hostPath": {"path": "/data/q"}}, "hostPath"),
                                               ({"image": {"reference": "r/m:v1"}}, "image")])
def test_model_volume_mounted_read_only(samples, source, volume_key):
    ms = copy.deepcopy(samples["ModelServer"])
    ms["spec"]["model"] = {"path": "/models/q", "servedModelName": "q", **source}
    pod = m.desired_engine_deployment(ms, samples["InferencePool"], IMAGE)["spec"]["template"]["spec"]
    (vol,) = [v for v in pod["volumes"] if v["name"] == "model"]
    assert volume_key in vol
    (mount,) = [v for v in pod["containers"][0]["volumeMounts"] if v["name"] == "model"]
    assert mount == {"name": "model", "mountPath": "/models/q", "readOnly": True}
    assert pod["containers"][0]["command"][2] == "/models/q"


def test_pod_options_and_pool_labels_win(samples):
    ms = copy.deepcopy(samples["ModelServer"])
    ms["spec"].update(podLabels={"app": "mine", "team": "a"}, nodeSelector={"gpu": "h100"},
                      tolerations=[{"key": "gpu", "operator": "Exists"}], image="custom:1",
                      resources={"limits": {"nvidia.com/gpu": 1}})
    dep = m.desired_engine_deployment(ms, samples["InferencePool"], IMAGE)
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
