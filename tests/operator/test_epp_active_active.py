"""Active-active EPP replicas (annotation kvgate.dev/epp-mode: active-active, operator/epp_peer_sync.py): every
replica serves, peer sync instead of a Lease, peers found by the EPP's pod watch, the pool's key in a Secret made
once, and the sync port admitted by the NetworkPolicy only from the pool's own EPP pods."""

from __future__ import annotations

import base64
import copy

import pytest

from kvgate.cli import build_parser
from kvgate.epp.peer_sync_keys import load_pool_key
from kvgate.operator import epp_peer_sync as aa
from kvgate.operator import pool as p
from kvgate.operator.config import OperatorConfig
from kvgate.operator.network_policy import desired_network_policy
from kvgate.operator.reconciler import Reconciler
from tests.operator.memory_kube import MemoryKube


def _pool(pool: dict, replicas: str | None = "2", mode: str | None = aa.ACTIVE_ACTIVE) -> dict:
    pool = copy.deepcopy(pool)
    annotations = pool["metadata"].setdefault("annotations", {})
    for key, value in ((p.REPLICAS_ANNOTATION, replicas), (aa.MODE_ANNOTATION, mode)):
        if value is not None:
            annotations[key] = value
    return pool


def _by_kind(objects: list[dict]) -> dict[str, dict]:
    return {o["kind"]: o for o in objects}


@pytest.mark.parametrize("value, mode", [(None, aa.ACTIVE_PASSIVE), ("active-passive", aa.ACTIVE_PASSIVE),
                                         ("active-active", aa.ACTIVE_ACTIVE)])
def test_mode_annotation(samples, value, mode):
    assert aa.epp_mode(_pool(samples["InferencePool"], mode=value)) == mode


@pytest.mark.parametrize("value", ["", "Active-Active", "both", "x" * 100])
def test_bad_mode_annotation_says_why(samples, value):
    with pytest.raises(ValueError, match="expected active-passive or active-active"):
        aa.epp_mode(_pool(samples["InferencePool"], mode=value))


def test_active_active_replicas_sync_instead_of_electing(samples, tmp_path):
    pool = _pool(samples["InferencePool"])
    objects = _by_kind(p.render_epp_objects(pool, "img", p.DEFAULT_EPP_CONFIG, replicas=2, active_active=True))
    assert not any("coordination.k8s.io" in r["apiGroups"] for r in objects["Role"]["rules"])  # no Lease
    assert {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]} in objects["Role"]["rules"]
    spec = objects["Deployment"]["spec"]
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    command = container["command"]
    assert "--ha-enable-leader-election" not in command
    assert pod["affinity"]["podAntiAffinity"]  # still spread across nodes
    # what the EPP's own parser makes of it, $(POD_IP) expanded as the kubelet does
    args = build_parser().parse_args([a.replace("$(POD_IP)", "10.1.2.3") for a in command[1:]])
    assert args.peer_sync_bind == f"tcp://10.1.2.3:{aa.EPP_PEER_SYNC_PORT}" and args.peer_sync_peer == []
    assert args.peer_sync_key_file == aa.KEY_FILE and not args.peer_sync_insecure
    assert dict(kv.split("=") for kv in args.peer_sync_discover_pods.split(",")) == spec["selector"]["matchLabels"]
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in container["env"]
    assert {"name": "peer-sync", "containerPort": aa.EPP_PEER_SYNC_PORT, "protocol": "TCP"} in container["ports"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "peer-sync"]
    assert mount == {"name": "peer-sync", "mountPath": aa.KEY_DIR, "readOnly": True}
    (volume,) = [v for v in pod["volumes"] if v["name"] == "peer-sync"]
    assert volume["secret"] == {"secretName": aa.secret_name(pool), "defaultMode": 0o440}
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]


def test_one_replica_or_active_passive_has_no_peer_sync(samples):
    for replicas, active_active in ((1, True), (3, False)):
        objects = _by_kind(p.render_epp_objects(_pool(samples["InferencePool"]), "img", p.DEFAULT_EPP_CONFIG,
                                                replicas=replicas, active_active=active_active))
        command = objects["Deployment"]["spec"]["template"]["spec"]["containers"][0]["command"]
        assert "--peer-sync-bind" not in command
        assert ("--ha-enable-leader-election" in command) == (replicas > 1)


def test_the_sync_port_admits_only_the_pools_own_epps(samples):
    pool = _pool(samples["InferencePool"])
    without, _ = desired_network_policy(pool, [])
    assert not any(aa.EPP_PEER_SYNC_PORT in [port["port"] for port in rule["ports"]]
                   for rule in without["spec"]["ingress"])
    policy, _ = desired_network_policy(pool, [], peer_sync=True)
    (rule,) = [r for r in policy["spec"]["ingress"] if any(x["port"] == aa.EPP_PEER_SYNC_PORT for x in r["ports"])]
    assert rule == {"from": [{"podSelector": {"matchLabels": policy["spec"]["podSelector"]["matchLabels"]}}],
                    "ports": [{"protocol": "TCP", "port": aa.EPP_PEER_SYNC_PORT}]}


def _reconcile(kube):
    Reconciler(kube, OperatorConfig(engine_image="img", epp_image="img", envoy_image="envoy",
                                    epp_high_availability=True)).reconcile_pool("default", "demo-pool")


def test_the_operator_makes_the_pools_key_once_and_never_rewrites_it(samples, tmp_path):
    kube = MemoryKube()
    for kind in ("GatewayClass", "Gateway", "HTTPRoute", "ModelServer"):
        kube.put(samples[kind])
    pool = _pool(samples["InferencePool"])
    kube.put(pool)
    _reconcile(kube)
    name = aa.secret_name(pool)
    secret = kube.stored("Secret", name)
    assert [o["uid"] for o in secret["metadata"]["ownerReferences"]] == [pool["metadata"]["uid"]]  # GC'd with it
    key_file = tmp_path / "pool.key"
    key_file.write_bytes(base64.b64decode(secret["data"][aa.SECRET_KEY]))
    assert load_pool_key(key_file)  # a key the EPP loads
    _reconcile(kube)  # a resync: the same key
    assert kube.stored("Secret", name)["data"] == secret["data"]
    assert ("GET", f"/api/v1/namespaces/default/secrets/{name}") not in kube.calls  # never read
    policy = kube.stored("NetworkPolicy", p.naming.epp_name(pool))
    assert any(x["port"] == aa.EPP_PEER_SYNC_PORT for r in policy["spec"]["ingress"] for x in r["ports"])
    deployment = kube.stored("Deployment", p.naming.epp_name(pool))
    assert deployment["spec"]["replicas"] == 2
    entry = next(e for e in kube.stored("InferencePool", "demo-pool")["status"]["parents"]
                 if e["controllerName"] == p.EPP_CONTROLLER_NAME)
    assert all(c["status"] == "True" for c in entry["conditions"] if c["type"] == "Accepted")


def test_a_bad_mode_is_a_condition_and_runs_active_passive(samples):
    kube = MemoryKube()
    for kind in ("GatewayClass", "Gateway", "HTTPRoute", "ModelServer"):
        kube.put(samples[kind])
    pool = _pool(samples["InferencePool"], mode="both")
    kube.put(pool)
    _reconcile(kube)
    deployment = kube.stored("Deployment", p.naming.epp_name(pool))
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    entry = next(e for e in kube.stored("InferencePool", "demo-pool")["status"]["parents"]
                 if e["controllerName"] == p.EPP_CONTROLLER_NAME)
    assert "InvalidEppMode" in str(entry["conditions"])
    assert "--ha-enable-leader-election" in command and "--peer-sync-bind" not in command
    assert kube.stored("Secret", aa.secret_name(pool)) is None
