"""Tenants cannot escalate through a ModelServer: host mounts, foreign images, labels that join another pool
(operator/tenancy.py through modelserver.validate_modelserver, desired_engine_deployment and the status)."""

import copy

import pytest

from kvgate.operator import modelserver as m
from kvgate.operator.tenancy import TenantPolicy, image_allowed, privileged_uses
from tests.operator.conftest import NOW

IMAGE = "ghcr.io/kvgate/kvgate:0.1.0"


def _refused(ms, pool, reason, policy=TenantPolicy(), others=()):
    """The ModelServer is refused for `reason`: no Deployment, Ready=False with that reason and a message."""
    problems = m.validate_modelserver(ms, pool, policy, list(others), IMAGE)
    assert [p["reason"] for p in problems] == [reason], problems
    assert m.desired_engine_deployment(ms, pool, IMAGE, policy, list(others)) is None
    status = m.modelserver_status(ms, None, pool, NOW, problems)
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", reason) and ready["message"]
    return problems[0]["message"]


@pytest.mark.parametrize("path", ["/", "/var/lib/kubelet", "/data/models"])
def test_host_path_is_refused_by_default(samples, path):
    ms = copy.deepcopy(samples["ModelServer"])
    ms["spec"]["model"] = {"path": "/models/m", "hostPath": {"path": path}}
    message = _refused(ms, samples["InferencePool"], "HostPathNotAllowed")
    assert path in message and "--allow-host-path" in message


def test_host_path_allowed_by_the_flag_and_reported_as_a_privileged_use(samples):
    ms = copy.deepcopy(samples["ModelServer"])
    ms["spec"]["model"] = {"path": "/models/m", "hostPath": {"path": "/data/models"}}
    dep = m.desired_engine_deployment(ms, samples["InferencePool"], IMAGE, TenantPolicy(allow_host_path=True))
    (vol,) = [v for v in dep["spec"]["template"]["spec"]["volumes"] if "hostPath" in v]
    assert vol["hostPath"] == {"path": "/data/models", "type": "Directory"}
    assert privileged_uses(ms, IMAGE) == ["hostPath /data/models"]


def test_image_override_is_refused_by_default(samples):
    ms = copy.deepcopy(samples["ModelServer"])
    ms["spec"]["image"] = "docker.io/attacker/miner:1"
    message = _refused(ms, samples["InferencePool"], "ImageNotAllowed")
    assert "docker.io/attacker/miner:1" in message and "--allow-image-prefix" in message
    # naming the operator's own engine image is no override
    ms["spec"]["image"] = IMAGE
    assert m.desired_engine_deployment(ms, samples["InferencePool"], IMAGE) is not None
    assert privileged_uses(ms, IMAGE) == []


def test_image_prefixes_match_at_a_boundary(samples):
    prefixes = ("registry.example/kvgate", "mirror.example/team/")
    assert image_allowed("registry.example/kvgate:1.2", prefixes, IMAGE)
    assert image_allowed("registry.example/kvgate/gpu:1", prefixes, IMAGE)
    assert image_allowed("registry.example/kvgate@sha256:abc", prefixes, IMAGE)
    assert image_allowed("mirror.example/team/kvgate:2", prefixes, IMAGE)
    assert not image_allowed("registry.example/kvgate-evil:1", prefixes, IMAGE)
    assert not image_allowed("registry.example/kvgatex", prefixes, IMAGE)
    assert not image_allowed("mirror.example/team-b/x:1", prefixes, IMAGE)
    assert image_allowed("anything:1", ("*",), IMAGE) and not image_allowed("anything:1", (), IMAGE)
    ms = copy.deepcopy(samples["ModelServer"])
    ms["spec"]["image"] = "registry.example/kvgate:1.2"
    dep = m.desired_engine_deployment(ms, samples["InferencePool"], IMAGE, TenantPolicy(image_prefixes=prefixes))
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example/kvgate:1.2"
    assert privileged_uses(ms, IMAGE) == ["image registry.example/kvgate:1.2"]


def test_an_api_key_secret_is_a_reference_and_on_record_with_a_foreign_image(samples):
    """apiKeySecretRef can name only a Secret of the pod's own namespace (secretKeyRef has no namespace), as a pod
    of the author's own could; with the operator's image it is no privileged use, with another image the log
    names the Secret that image's code can read."""
    ms = copy.deepcopy(samples["ModelServer"])
    ms["spec"]["engine"]["apiKeySecretRef"] = {"name": "llm-keys", "key": "token"}
    dep = m.desired_engine_deployment(ms, samples["InferencePool"], IMAGE)
    (env,) = [e for e in dep["spec"]["template"]["spec"]["containers"][0]["env"] if e["name"] == "VLLM_API_KEY"]
    assert set(env["valueFrom"]["secretKeyRef"]) == {"name", "key", "optional"}  # no namespace: the pod's own
    assert dep["metadata"]["namespace"] == ms["metadata"]["namespace"]
    assert privileged_uses(ms, IMAGE) == []
    ms["spec"]["image"] = "registry.example/kvgate:1.2"
    assert privileged_uses(ms, IMAGE) == ["image registry.example/kvgate:1.2",
                                         "Secret 'llm-keys' (key 'token') in that image's environment"]


def _pool(name, labels, ns="default"):
    return {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": name, "namespace": ns, "uid": f"uid-{name}"},
            "spec": {"selector": {"matchLabels": labels}, "targetPorts": [{"number": 8000}],
                     "endpointPickerRef": {"name": f"{name}-epp", "port": {"number": 9002}}}}


def test_pod_labels_that_join_another_pool_are_refused(samples):
    ms, pool = copy.deepcopy(samples["ModelServer"]), samples["InferencePool"]
    victim = _pool("victim", {"app": "victim-llm", "tier": "gold"})
    ms["spec"]["podLabels"] = {"tier": "gold"}
    assert m.desired_engine_deployment(ms, pool, IMAGE, other_pools=[victim]) is not None  # one label short
    ms["spec"]["podLabels"] = {"app.kubernetes.io/x": "1", "tier": "gold"}
    # the victim pool selects app=victim-llm too, which the tenant cannot set (the own pool's key)...
    assert m.validate_modelserver(ms, pool, other_pools=[victim]) == []
    # ... but a pool selecting a label the tenant can set is reachable
    victim = _pool("victim", {"tier": "gold"})
    message = _refused(ms, pool, "JoinsOtherPool", others=[victim])
    assert "'victim'" in message and "tier=gold" in message
    # a pool in another namespace selects no pod of this one; the own pool is never "another"
    assert m.validate_modelserver(ms, pool, other_pools=[_pool("victim", {"tier": "gold"}, ns="elsewhere"), pool]) == []


def test_a_tenant_pool_whose_selector_lands_in_another_pool_is_refused(samples):
    """A tenant may create pools: a pool selecting app=victim-llm,x=1 puts its ModelServer's pods into the
    pool selecting app=victim-llm, with no podLabels at all."""
    ms = copy.deepcopy(samples["ModelServer"])
    own = _pool("mine", {"app": "victim-llm", "x": "1"})
    ms["spec"]["poolRef"]["name"] = "mine"
    _refused(ms, own, "JoinsOtherPool", others=[own, _pool("victim", {"app": "victim-llm"})])


@pytest.mark.parametrize("labels,key", [({"app": "other"}, "app"),
                                        ({"app.kubernetes.io/managed-by": "me"}, "app.kubernetes.io/managed-by"),
                                        ({"app.kubernetes.io/instance": "x"}, "app.kubernetes.io/instance")])
def test_pod_labels_cannot_change_the_operators_labels(samples, labels, key):
    ms = copy.deepcopy(samples["ModelServer"])
    ms["spec"]["podLabels"] = {"team": "a", **labels}
    message = _refused(ms, samples["InferencePool"], "ReservedLabel")
    assert key in message


def test_refusal_keeps_what_was_running(samples):
    """An edit that is refused changes nothing: the status reports it while the counts still come from the
    Deployment made from the earlier spec."""
    ms, pool = copy.deepcopy(samples["ModelServer"]), samples["InferencePool"]
    running = m.desired_engine_deployment(ms, pool, IMAGE)
    running["status"] = {"replicas": 2, "readyReplicas": 2}
    ms["spec"]["image"] = "evil:1"
    problems = m.validate_modelserver(ms, pool, operator_image=IMAGE)
    status = m.modelserver_status(ms, running, pool, NOW, problems)
    assert (status["replicas"], status["readyReplicas"]) == (2, 2)
    assert not m.is_ready(status)
