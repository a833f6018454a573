"""The autoscaler's inputs and outputs: the EPP's real /metrics page served over HTTP (epp/metrics.py's exporter),
read and checked (autoscale_signals.py), decided on, recorded as ModelServer status and Events, and rendered as
the engine Deployment's replicas by the ModelServer reconciler (autoscaler.py, autoscaling_spec.py)."""

from __future__ import annotations

import copy
import time

import pytest
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from kvgate.operator import naming
from kvgate.operator.apply import DEPLOYMENT
from kvgate.operator.autoscale_policy import Signals
from kvgate.operator.autoscale_signals import EppReading, parse_epp_page, pool_signals
from kvgate.operator.autoscaler import Autoscaler, fetch_page
from kvgate.operator.autoscaling_spec import autoscaling_problems, policy_of, rendered_replicas
from kvgate.operator.config import OperatorConfig
from kvgate.operator.modelserver import validate_modelserver
from kvgate.operator.reconciler import Reconciler
from tests.operator.epp_exporter import FakeEpp
from tests.operator.memory_kube import MemoryKube


@pytest.fixture
def epp():
    fake = FakeEpp()
    yield fake
    fake.close()


def test_the_epps_page_reduces_to_the_pools_load(epp):
    epp.set([(3, 2, 0.5), (1, 4, 0.7)], held=6)
    epp.metrics.observe_flow("default", 0, "Dispatched", 2.0)
    epp.metrics.observe_flow("default", 0, "EvictedTTL", 60.0)  # not a dispatch: not a wait that counts
    reading = parse_epp_page(epp.page())
    assert reading == EppReading(endpoints=2, held=6, held_without_endpoints=0, waiting=4, running=6,
                                 kv_utilization=pytest.approx(0.6), wait_sum_s=2.0, wait_count=1)


def test_requests_held_for_an_empty_pool_are_their_own_metric(epp):
    epp.set([], held=3)
    assert "kvgate_epp_flow_control_held_without_endpoints 3.0" in epp.page()
    reading = parse_epp_page(epp.page())
    assert (reading.endpoints, reading.held, reading.held_without_endpoints) == (0, 3, 3)
    epp.set([(0, 0, 0.0)], held=3)
    assert parse_epp_page(epp.page()).held_without_endpoints == 0


@pytest.mark.parametrize("line, why", [
    ("kvgate_epp_endpoint_kv_cache_usage{endpoint=\"a\"} 1.5", r"out of range \[0, 1\]"),
    ("kvgate_epp_endpoint_queue_size{endpoint=\"a\"} NaN", "out of range"),
    ("kvgate_epp_endpoint_running_requests{endpoint=\"a\"} -1", "out of range"),
    ("inference_extension_flow_control_queue_size{fairness_id=\"x\",priority=\"0\"} +Inf", "out of range"),
    ("kvgate_epp_endpoint_queue_size{endpoint=\"a\" 3", "not Prometheus text"),
])
def test_a_page_with_a_bad_value_is_refused_whole(line, why):
    with pytest.raises(ValueError, match=why):
        parse_epp_page(f"# TYPE x gauge\nx 1\n{line}\n")


def test_a_page_with_too_many_samples_is_refused(monkeypatch):
    from kvgate.operator import autoscale_signals
    monkeypatch.setattr(autoscale_signals, "MAX_SAMPLES", 10)
    page = "".join(f"kvgate_epp_endpoint_queue_size{{endpoint=\"e{i}\"}} 1\n" for i in range(11))
    with pytest.raises(ValueError, match="more than 10 samples"):
        parse_epp_page(page)


def test_pool_signals_take_the_largest_epp_and_the_waits_growth():
    before = {"a": EppReading(wait_sum_s=10, wait_count=5)}
    now = {"a": EppReading(endpoints=2, held=4, waiting=1, running=3, kv_utilization=0.4, wait_sum_s=16,
                           wait_count=8),
           "b": EppReading(endpoints=2, held=0, waiting=1, running=3, kv_utilization=0.5)}  # a standby
    assert pool_signals(now, before) == Signals(ready_endpoints=2, held=4, waiting=1, running=3,
                                                kv_utilization=0.5, queue_wait_s=2.0)
    assert pool_signals(now, {}).queue_wait_s is None  # no growth known on the first look
    assert pool_signals({}, before) is None


def test_fetch_is_bounded_in_size():
    registry = CollectorRegistry()
    gauge = Gauge("big", "a big page", ["i"], registry=registry)
    for i in range(2000):
        gauge.labels(str(i)).set(i)
    server, thread = start_http_server(0, "127.0.0.1", registry=registry)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        assert "big{i=\"1999\"}" in fetch_page(url)
        with pytest.raises(ValueError, match="larger than 4096 bytes"):
            fetch_page(url, max_bytes=4096)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


# --- the spec ----------------------------------------------------------------------------------------------------

def test_spec_fields_are_checked_again_where_the_schema_cannot():
    assert autoscaling_problems({"minReplicas": 3, "maxReplicas": 2}) == ["minReplicas (3) must be <= maxReplicas (2)"]
    assert "without maxReplicas" in autoscaling_problems({"minReplicas": 0})[0]
    assert "without maxReplicas" in autoscaling_problems({"autoscaling": {"tolerance": 0.2}})[0]
    assert "not one of operator, keda" in autoscaling_problems({"maxReplicas": 2,
                                                                "autoscaling": {"provider": "hpa"}})[0]
    assert autoscaling_problems({"minReplicas": 0, "maxReplicas": 1000}) == []
    policy = policy_of({"minReplicas": 0, "maxReplicas": 5, "autoscaling": {"targetWaitingPerReplica": 2,
                                                                             "scaleDownDelaySeconds": 0}})
    assert (policy.min_replicas, policy.max_replicas, policy.target_waiting_per_replica,
            policy.scale_down_delay_s, policy.scale_down_stabilization_s) == (0, 5, 2, 0, 300.0)


def test_rendered_replicas_follow_the_decision_until_a_user_sets_replicas():
    ms = {"spec": {"replicas": 1, "minReplicas": 0, "maxReplicas": 4}}
    assert rendered_replicas(ms) == 1
    ms["status"] = {"autoscaling": {"desiredReplicas": 3, "specReplicas": 1}}
    assert rendered_replicas(ms) == 3
    ms["spec"]["replicas"] = 9  # kubectl scale: the user's count, clamped, at once
    assert rendered_replicas(ms) == 4
    assert rendered_replicas({"spec": {"replicas": 7}, "status": {"autoscaling": {"desiredReplicas": 1}}}) == 7
    keda = {"spec": {"replicas": 2, "maxReplicas": 4, "autoscaling": {"provider": "keda"}},
            "status": {"autoscaling": {"desiredReplicas": 3, "specReplicas": 2}}}
    assert rendered_replicas(keda) == 2  # KEDA's HPA writes spec.replicas


# --- the loop against the in-memory API server and the real exporter ---------------------------------------------

def _ready_pod(name: str, labels: dict, ip: str = "127.0.0.1") -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default", "labels": labels},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}}


@pytest.fixture
def cluster(samples, epp):
    kube = MemoryKube()
    pool = kube.put(samples["InferencePool"])
    ms = copy.deepcopy(samples["ModelServer"])
    ms["spec"].update(replicas=0, minReplicas=0, maxReplicas=4,
                      autoscaling={"targetWaitingPerReplica": 2, "scaleDownStabilizationSeconds": 30,
                                   "scaleDownDelaySeconds": 10})
    kube.put(ms)
    kube.put(_ready_pod("demo-pool-epp-1", naming.selector_labels("epp", naming.name_of(pool))))
    reconciler = Reconciler(kube, OperatorConfig("img", "img", "envoy"))
    clock = [1000.0]
    enqueued = []
    scaler = Autoscaler(kube, "default", enqueued.append, metrics_port=epp.port, clock=lambda: clock[0])
    return kube, reconciler, scaler, clock, enqueued


def _deployment_replicas(kube, reconciler) -> int:
    reconciler.reconcile_modelserver("default", "demo-llm")
    return kube.stored("Deployment", "demo-llm")["spec"]["replicas"]


def _set_ready(kube, n: int) -> None:
    dep = kube.stored("Deployment", "demo-llm")
    dep["status"] = {"replicas": n, "readyReplicas": n}


def test_from_zero_out_and_back_in(cluster, epp):
    kube, reconciler, scaler, clock, enqueued = cluster
    assert _deployment_replicas(kube, reconciler) == 0
    epp.set([], held=1)  # the first request, held by the EPP for an empty pool
    scaler.run_once()
    ms = kube.stored("ModelServer", "demo-llm")
    assert ms["status"]["autoscaling"]["desiredReplicas"] == 1
    assert enqueued == [("ModelServer", "default", "demo-llm")]
    assert _deployment_replicas(kube, reconciler) == 1
    scaled = next(c for c in kube.stored("ModelServer", "demo-llm")["status"]["conditions"] if c["type"] == "Scaled")
    assert scaled["reason"] == "ScaledFromZero" and "held with no ready endpoint" in scaled["message"]
    assert [(e["type"], e["reason"]) for e in kube.events] == [("Normal", "ScaledFromZero")]
    assert kube.events[0]["involvedObject"]["name"] == "demo-llm"

    # a load step: 1 ready, 7 waiting at target 2 each -> 4 (the cap)
    _set_ready(kube, 1)
    epp.set([(5, 4, 0.5)], held=2)
    clock[0] += 5
    scaler.run_once()
    assert _deployment_replicas(kube, reconciler) == 4
    conditions = {c["type"]: c for c in kube.stored("ModelServer", "demo-llm")["status"]["conditions"]}
    assert conditions["Ready"]["reason"] == "ReplicasNotReady"  # the reconciler kept the autoscaler's conditions
    assert (conditions["Scaled"]["reason"], conditions["ScalingActive"]["status"]) == ("ScaledUp", "True")

    # idle: down only after the delay and the window, then to zero
    _set_ready(kube, 4)
    epp.set([(0, 0, 0.0)] * 4)
    counts = []
    for _ in range(10):
        clock[0] += 5
        scaler.run_once()
        counts.append(_deployment_replicas(kube, reconciler))
    assert counts[0] == 4 and counts[-1] == 0
    assert counts.index(0) * 5 >= 30
    assert kube.events[-1]["reason"] == "ScaledToZero"


def test_a_user_setting_replicas_is_not_fought(cluster, epp):
    kube, reconciler, scaler, clock, _ = cluster
    epp.set([(0, 1, 0.1)])
    scaler.run_once()  # steady at 0 -> running load on another member: recorded
    ms = kube.stored("ModelServer", "demo-llm")
    ms["spec"]["replicas"] = 3  # kubectl scale
    assert _deployment_replicas(kube, reconciler) == 3
    _set_ready(kube, 3)
    epp.set([(0, 1, 0.1)] * 3)  # light load: the autoscaler would go down, but not within the delay
    clock[0] += 5
    scaler.run_once()
    assert _deployment_replicas(kube, reconciler) == 3
    assert kube.stored("ModelServer", "demo-llm")["status"]["autoscaling"]["specReplicas"] == 3


def test_no_epp_answers_keeps_the_count_and_warns_once(cluster, epp):
    kube, reconciler, scaler, clock, _ = cluster
    scaler.metrics_port = 1  # nothing listens there
    for _ in range(2):
        clock[0] += 5
        scaler.run_once()
    active = next(c for c in kube.stored("ModelServer", "demo-llm")["status"]["conditions"]
                  if c["type"] == "ScalingActive")
    assert (active["status"], active["reason"]) == ("False", "FailedGetMetrics")
    assert [e["reason"] for e in kube.events] == ["FailedGetMetrics"]
    assert _deployment_replicas(kube, reconciler) == 0


def test_min_above_max_is_a_condition(samples):
    ms = copy.deepcopy(samples["ModelServer"])
    ms["spec"].update(minReplicas=3, maxReplicas=2)
    problems = validate_modelserver(ms, samples["InferencePool"])
    assert problems == [{"reason": "InvalidSpec", "message": "minReplicas (3) must be <= maxReplicas (2)"}]


def test_a_misshapen_autoscaling_status_falls_back_to_spec_replicas():
    for status in ({"autoscaling": "x"}, {"autoscaling": {"desiredReplicas": "3", "specReplicas": 1}}, "x",
                   {"autoscaling": {"desiredReplicas": True, "specReplicas": 1}}):
        assert rendered_replicas({"spec": {"replicas": 1, "maxReplicas": 4}, "status": status}) == 1


def test_two_modelservers_of_one_pool_read_its_epp_once_per_look(cluster, epp, samples):
    kube, reconciler, scaler, clock, _ = cluster
    other = copy.deepcopy(kube.stored("ModelServer", "demo-llm"))
    other["metadata"] = {"name": "demo-llm-b", "namespace": "default"}
    kube.put(other)
    fetched = []
    scaler.fetch = lambda url: fetched.append(url) or epp.page()
    epp.set([], held=1)
    scaler.run_once()
    assert len(fetched) == 1
    assert {kube.stored("ModelServer", n)["status"]["autoscaling"]["desiredReplicas"]
            for n in ("demo-llm", "demo-llm-b")} == {1}


def test_an_invalid_autoscaling_spec_is_left_to_the_reconcilers_condition(cluster, epp):
    kube, reconciler, scaler, clock, _ = cluster
    kube.stored("ModelServer", "demo-llm")["spec"].update(minReplicas=5, maxReplicas=4)
    epp.set([], held=1)
    scaler.run_once()
    assert "autoscaling" not in (kube.stored("ModelServer", "demo-llm").get("status") or {})
    reconciler.reconcile_modelserver("default", "demo-llm")
    ready = next(c for c in kube.stored("ModelServer", "demo-llm")["status"]["conditions"] if c["type"] == "Ready")
    assert (ready["reason"], ready["message"]) == ("InvalidSpec", "minReplicas (5) must be <= maxReplicas (4)")


def test_only_the_leading_replica_scales(cluster, epp):
    """A standby operator replica (Reconciler.leading clear) neither reads the EPPs nor writes a decision."""
    kube, reconciler, _, _, _ = cluster
    reads = []
    reconciler.autoscaler.fetch = lambda url: reads.append(url) or fetch_page(url)
    reconciler.autoscaler.interval_s = 0.01
    reconciler.autoscaler.metrics_port = epp.port
    reconciler.set_leading(False)
    epp.set([], held=1)
    reconciler.autoscaler.start()
    try:
        time.sleep(0.3)
        assert reads == [] and kube.events == []
        assert "status" not in kube.stored("ModelServer", "demo-llm") or \
            "autoscaling" not in kube.stored("ModelServer", "demo-llm")["status"]
        reconciler.set_leading(True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            status = kube.stored("ModelServer", "demo-llm").get("status") or {}
            if status.get("autoscaling", {}).get("desiredReplicas") == 1:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the leader never scaled the held request's pool from zero")
    finally:
        reconciler.autoscaler.stop()
