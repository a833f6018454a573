"""Temporary failures are retried with a backoff, permanent ones are a status condition and no retry loop
(failures.py, kopf's TemporaryError / PermanentError). The reconciles run against MemoryKube with faults
injected where the API server would answer them: a 409 or 503 is retried until it clears; a 403 becomes the
object's ReconcileFailed condition, logged once, and is picked up again once the permission is granted."""

import copy
import http.client
import logging
import time

import kopf
import pytest
import urllib3

from kvgate.operator import modelserver_reconciler, naming
from kvgate.operator.apply import ApiError
from kvgate.operator.failures import REASON, classify
from kvgate.operator.config import OperatorConfig
from kvgate.operator.reconciler import Reconciler
from kvgate.operator.workqueue import WorkQueue
from tests.operator.memory_kube import MemoryKube

IMAGE = "ghcr.io/kvgate/kvgate:0.1.0"


class FaultyKube(MemoryKube):
    """MemoryKube whose writes to a path answer the queued faults first (an HTTP status, or an exception)."""

    def __init__(self) -> None:
        super().__init__()
        self.faults: dict[tuple[str, str], list] = {}  # (method, path) -> what the next calls get

    def fail(self, method: str, path: str, *answers) -> None:
        self.faults.setdefault((method, path), []).extend(answers)

    def request(self, method, path, body=None, *, query=None, content_type=None):
        pending = self.faults.get((method, path))
        if pending:
            answer = pending.pop(0)
            if isinstance(answer, BaseException):
                raise answer
            raise ApiError(answer, method, path, '{"message": "injected"}')
        return super().request(method, path, body, query=query, content_type=content_type)


ENGINE = "/apis/apps/v1/namespaces/default/deployments/demo-llm"
EPP = "/apis/apps/v1/namespaces/default/deployments/demo-pool-epp"
ENVOY_CONFIG = "/api/v1/namespaces/default/configmaps/inference-gateway-envoy"
EPP_CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
  - pluginRef: max-score-picker
"""


@pytest.fixture
def cluster(samples):
    kube = FaultyKube()
    for kind in ("InferencePool", "ModelServer", "GatewayClass", "Gateway", "HTTPRoute"):
        kube.put(samples[kind])
    return kube, Reconciler(kube, OperatorConfig(engine_image=IMAGE, epp_image=IMAGE, envoy_image="envoy:test"))


def _condition(obj: dict, type_: str) -> dict:
    return next(c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_)


def _epp_accepted(kube, pool="demo-pool") -> dict:
    entry = next(p for p in kube.stored("InferencePool", pool)["status"]["parents"]
                 if p["controllerName"] == "kvgate.dev/endpoint-picker")
    return next(c for c in entry["conditions"] if c["type"] == "Accepted")


@pytest.mark.parametrize("exc, temporary", [
    (ApiError(409, "PATCH", "/x"), True), (ApiError(429, "GET", "/x"), True), (ApiError(500, "GET", "/x"), True),
    (ApiError(503, "GET", "/x"), True), (ApiError(504, "GET", "/x"), True), (ApiError(408, "GET", "/x"), True),
    (ApiError(401, "GET", "/x"), True), (ApiError(0, "GET", "/x"), True),
    (ConnectionRefusedError(111, "refused"), True), (TimeoutError("read timed out"), True),
    (urllib3.exceptions.MaxRetryError(None, "/x", "refused"), True),
    (urllib3.exceptions.ProtocolError("Connection aborted"), True), (http.client.RemoteDisconnected("gone"), True),
    (ApiError(400, "PATCH", "/x"), False), (ApiError(403, "PATCH", "/x"), False),
    (ApiError(404, "PATCH", "/x"), False), (ApiError(422, "PATCH", "/x"), False),
    (ValueError("spec.engine: not a mapping"), False), (KeyError("name"), False), (TypeError("bad"), False),
    (kopf.TemporaryError("later", delay=7), True), (kopf.PermanentError("never"), False),
])
def test_classify_tells_temporary_from_permanent(exc, temporary):
    failure = classify(exc)
    assert isinstance(failure, kopf.TemporaryError if temporary else kopf.PermanentError)
    if isinstance(exc, (kopf.TemporaryError, kopf.PermanentError)):
        assert failure is exc
    else:
        assert failure.__cause__ is exc and str(exc) in str(failure)


def test_a_temporary_failure_is_retried_with_backoff_until_it_clears(cluster):
    kube, reconciler = cluster
    key = ("ModelServer", "default", "demo-llm")
    kube.fail("PATCH", ENGINE, 409, 503, ConnectionResetError(104, "reset"))
    assert reconciler.process(key) == 1.0   # 1 s, then doubling
    assert 0.9 < reconciler.queue.pending_retries()[key] <= 1.0
    assert reconciler.process(key) == 2.0
    assert reconciler.process(key) == 4.0
    assert kube.stored("Deployment", "demo-llm") is None
    assert reconciler.process(key) is None  # cleared: applied, and the backoff starts over next time
    assert kube.stored("Deployment", "demo-llm") is not None
    assert _condition(kube.stored("ModelServer", "demo-llm"), "Ready")["reason"] != REASON
    kube.fail("PATCH", ENGINE, 503)
    assert reconciler.process(key) == 1.0
    # kopf's own TemporaryError says its delay
    kube.fail("GET", "/apis/kvgate.dev/v1alpha1/namespaces/default/modelservers/demo-llm",
              kopf.TemporaryError("the cache is warming up", delay=7))
    assert reconciler.process(key) == 7


def test_a_permanent_failure_is_a_condition_logged_once_and_not_retried(cluster, caplog):
    kube, reconciler = cluster
    key = ("ModelServer", "default", "demo-llm")
    kube.fail("PATCH", ENGINE, 403, 403)
    with caplog.at_level(logging.ERROR, logger="kvgate.operator"):
        assert reconciler.process(key) is None
        assert reconciler.process(key) is None  # the resync meets it again: same condition, no new log line
    assert reconciler.queue.pending_retries() == {}
    ready = _condition(kube.stored("ModelServer", "demo-llm"), "Ready")
    assert (ready["status"], ready["reason"]) == ("False", REASON) and "HTTP 403" in ready["message"]
    assert ready["observedGeneration"] == 1
    assert len([r for r in caplog.records if "failed permanently" in r.message]) == 1
    assert not any(r.exc_info for r in caplog.records)  # the API server's answer: a line, no traceback
    # the permission granted: the next resync applies and the condition clears
    assert reconciler.process(key) is None
    assert kube.stored("Deployment", "demo-llm") is not None
    assert _condition(kube.stored("ModelServer", "demo-llm"), "Ready")["reason"] != REASON


def test_a_pools_permanent_failure_is_its_epp_entry_and_other_pools_go_on(cluster, samples):
    kube, reconciler = cluster
    other = copy.deepcopy(samples["InferencePool"])
    other["metadata"].update(name="other", uid="uid-other")
    other["spec"]["endpointPickerRef"]["name"] = "other-epp"
    kube.put(other)
    kube.fail("PATCH", EPP, 422)
    # a ConfigMap labelled for both pools wakes both: the first one's failure does not stop the second
    kube.put({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg", "namespace": "default"},
              "data": {"epp.yaml": EPP_CONFIG}})
    for name in ("demo-pool", "other"):  # (no ModelServer joins "other": the annotation says its EPP is ours)
        kube.objects[("inferencepools", "default", name)]["metadata"]["annotations"] = {
            "kvgate.dev/epp-config": "cfg", "kvgate.dev/endpoint-picker": "managed"}
    assert reconciler.process(("ConfigUsers", "default", "cfg")) is None
    accepted = _epp_accepted(kube)
    assert (accepted["status"], accepted["reason"]) == ("False", REASON) and "HTTP 422" in accepted["message"]
    assert kube.stored("Deployment", "other-epp") is not None
    assert _epp_accepted(kube, "other")["status"] == "True"
    assert reconciler.queue.pending_retries() == {}


def test_a_gateways_failures_temporary_retry_the_key_permanent_are_programmed_false(cluster):
    kube, reconciler = cluster
    gateway = naming.name_of(kube.stored("Gateway", "inference-gateway"))
    kube.fail("PATCH", ENVOY_CONFIG, 503)
    assert reconciler.process(("Gateways",)) == 1.0
    kube.fail("PATCH", ENVOY_CONFIG, 403)
    assert reconciler.process(("Gateways",)) is None
    programmed = _condition(kube.stored("Gateway", gateway), "Programmed")
    assert (programmed["status"], programmed["reason"]) == ("False", REASON) and "HTTP 403" in programmed["message"]
    assert reconciler.process(("Gateways",)) is None
    assert kube.stored("ConfigMap", f"{gateway}-envoy") is not None
    assert _condition(kube.stored("Gateway", gateway), "Programmed")["reason"] != REASON


def test_a_permanent_failure_without_an_object_is_logged_once_not_retried(cluster, caplog):
    kube, reconciler = cluster
    key = ("PoolMembers", "default", "demo-pool")
    kube.fail("GET", "/apis/kvgate.dev/v1alpha1/namespaces/default/modelservers", 403, 403)
    with caplog.at_level(logging.ERROR, logger="kvgate.operator"):
        assert reconciler.process(key) is None
        assert reconciler.process(key) is None
    assert reconciler.queue.pending_retries() == {}
    assert len([r for r in caplog.records if "failed permanently" in r.message]) == 1


def test_an_operator_exception_is_permanent_and_logged_with_its_traceback(cluster, caplog, monkeypatch):
    kube, reconciler = cluster

    def broken_render(*args, **kwargs):  # a bug in the operator's own code, which a retry cannot mend (specs
        raise AttributeError("'list' object has no attribute 'get'")  # it can check are InvalidSpec first)

    monkeypatch.setattr(modelserver_reconciler, "desired_engine_deployment", broken_render)
    with caplog.at_level(logging.ERROR, logger="kvgate.operator"):
        assert reconciler.process(("ModelServer", "default", "demo-llm")) is None
    assert reconciler.queue.pending_retries() == {}
    ready = _condition(kube.stored("ModelServer", "demo-llm"), "Ready")
    assert (ready["reason"], ready["status"]) == (REASON, "False") and "'list' object" in ready["message"]
    logged = [r for r in caplog.records if "failed permanently" in r.message]
    assert len(logged) == 1 and logged[0].exc_info[0] is AttributeError


def test_work_queue_keeps_one_retry_per_key_the_earliest():
    q = WorkQueue()
    q.add(("a",), delay_s=0.3)
    q.add(("a",), delay_s=0.1)   # sooner: replaces it
    q.add(("a",), delay_s=0.5)   # later: a retry is already due sooner
    assert set(q.pending_retries()) == {("a",)}
    start = time.monotonic()
    assert q.get() == ("a",) and 0.09 <= time.monotonic() - start < 0.3
    assert q.pending_retries() == {}
    q.add(("b",), delay_s=0.35)
    assert q.get() == ("b",)   # the stale 0.3 s and 0.5 s entries of "a" yield nothing
    q.add(("c",))
    q.stop()
    assert q.get() is None
