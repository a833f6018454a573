"""The autoscaler's decisions and signals as operator metrics (autoscale_metrics.py): a real Autoscaler reading the
EPP's real exporter over HTTP, its series scraped from the operator's real metrics server (OperatorMetrics)."""

from __future__ import annotations

import copy

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.operator import naming
from kvgate.operator.apply import MODELSERVER, POOL
from kvgate.operator.autoscaler import Autoscaler
from kvgate.operator.config import OperatorConfig
from kvgate.operator.metrics import OperatorMetrics
from kvgate.operator.reconciler import Reconciler
from tests.operator.epp_exporter import FakeEpp
from tests.operator.memory_kube import MemoryKube
from tests.procs import free_port

MS = ("default", "demo-llm")


@pytest.fixture
def epp():
    fake = FakeEpp()
    yield fake
    fake.close()


@pytest.fixture
def served():
    """OperatorMetrics serving on loopback, and a scrape of it: {(sample name, sorted labels): value}."""
    metrics, port = OperatorMetrics(), free_port()
    metrics.serve("127.0.0.1", port)

    def scrape() -> dict[tuple[str, tuple], float]:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    yield metrics, scrape
    metrics.close()


def _ready_pod(name: str, labels: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default", "labels": labels},
            "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}


@pytest.fixture
def cluster(samples, epp, served):
    kube = MemoryKube()
    pool = kube.put(samples["InferencePool"])
    ms = copy.deepcopy(samples["ModelServer"])
    ms["spec"].update(replicas=0, minReplicas=0, maxReplicas=4,
                      autoscaling={"targetWaitingPerReplica": 2, "scaleDownDelaySeconds": 0})
    kube.put(ms)
    kube.put(_ready_pod("demo-pool-epp-1", naming.selector_labels("epp", naming.name_of(pool))))
    clock = [1000.0]
    scaler = Autoscaler(kube, "default", lambda key: None, metrics_port=epp.port, clock=lambda: clock[0],
                        metrics=served[0].autoscale)
    return kube, scaler, clock


def _scaled_to(kube, desired: int, ready: int) -> None:
    """The ModelServer's recorded count, and its engine Deployment with `ready` ready replicas."""
    ms = kube.stored("ModelServer", "demo-llm")
    ms["status"]["autoscaling"]["desiredReplicas"] = desired
    kube.put({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {
        "name": naming.engine_deployment_name(ms), "namespace": "default"}, "status": {"readyReplicas": ready}})


def _of(scraped: dict, name: str, key: tuple[str, str] = MS, **extra) -> float | None:
    labels = tuple(sorted({"namespace": key[0], "modelserver": key[1], **extra}.items()))
    return scraped.get((name, labels))


def _autoscale_series(scraped: dict) -> list:
    return [k for k in scraped if k[0].startswith("kvgate_operator_autoscale_")
            and k[0] != "kvgate_operator_autoscale_untracked_modelservers"]


def test_each_look_exports_the_decision_and_its_signals(cluster, epp, served):
    kube, scaler, clock = cluster
    _, scrape = served
    assert _autoscale_series(scrape()) == []  # nothing looked at yet
    epp.set([], held=1)  # the first request, held for an empty pool
    scaler.run_once()
    got = scrape()
    p = "kvgate_operator_autoscale_"
    assert (_of(got, p + "desired_replicas"), _of(got, p + "current_replicas"), _of(got, p + "ready_replicas"),
            _of(got, p + "min_replicas"), _of(got, p + "max_replicas")) == (1, 0, 0, 0, 4)
    assert (_of(got, p + "scaling_active"), _of(got, p + "ready_endpoints"), _of(got, p + "held_without_endpoints"),
            _of(got, p + "waiting_requests")) == (1, 0, 1, 1)
    assert _of(got, p + "scaled_total", reason="ScaledFromZero") == 1
    assert _of(got, p + "usage_ratio", signal="waiting") is None  # no ready endpoint: no load per endpoint
    assert _of(got, p + "queue_wait_seconds") is None  # the wait is the growth since a previous look

    # the replica came up; a load step: 7 waiting on 1 endpoint at target 2 each, KV 0.4 of 0.8
    _scaled_to(kube, 1, 1)
    epp.set([(5, 4, 0.4)], held=2)
    epp.metrics.observe_flow("default", 0, "Dispatched", 3.0)
    clock[0] += 5
    scaler.run_once()
    got = scrape()
    assert (_of(got, p + "desired_replicas"), _of(got, p + "current_replicas"), _of(got, p + "ready_replicas")) \
        == (4, 1, 1)
    assert _of(got, p + "waiting_requests") == 7 and _of(got, p + "kv_utilization") == pytest.approx(0.4)
    assert _of(got, p + "usage_ratio", signal="waiting") == pytest.approx(3.5)
    assert _of(got, p + "usage_ratio", signal="kv_utilization") == pytest.approx(0.5)
    assert _of(got, p + "queue_wait_seconds") == pytest.approx(3.0)  # one dispatch of 3 s since the last look
    assert (_of(got, p + "scaled_total", reason="ScaledFromZero"), _of(got, p + "scaled_total", reason="ScaledUp"),
            _of(got, p + "scaled_total", reason="ScaledDown")) == (1, 1, None)

    # steady: a look that keeps the count counts no scale
    _scaled_to(kube, 4, 4)
    epp.set([(2, 2, 0.4)] * 4, held=0)
    epp.metrics.observe_flow("default", 0, "Dispatched", 1.0)
    clock[0] += 5
    scaler.run_once()
    got = scrape()
    assert _of(got, p + "desired_replicas") == 4 and _of(got, p + "scaled_total", reason="ScaledUp") == 1
    assert _of(got, p + "queue_wait_seconds") == pytest.approx(1.0)
    assert _of(got, p + "usage_ratio", signal="queue_wait") == pytest.approx(1.0)


def test_a_deleted_modelservers_series_are_dropped(cluster, epp, served, samples):
    kube, scaler, clock = cluster
    _, scrape = served
    other = copy.deepcopy(kube.stored("ModelServer", "demo-llm"))
    other["metadata"] = {"name": "demo-llm-b", "namespace": "default"}
    kube.put(other)
    epp.set([], held=1)
    scaler.run_once()
    got = scrape()
    assert _of(got, "kvgate_operator_autoscale_desired_replicas") == 1
    assert _of(got, "kvgate_operator_autoscale_desired_replicas", ("default", "demo-llm-b")) == 1
    del kube.objects[(MODELSERVER.plural, "default", "demo-llm")]
    clock[0] += 5
    scaler.run_once()
    left = {dict(labels)["modelserver"] for _, labels in _autoscale_series(scrape())}
    assert left == {"demo-llm-b"}
    # and one whose pool went away: no decision, no series
    del kube.objects[(POOL.plural, "default", naming.name_of(samples["InferencePool"]))]
    clock[0] += 5
    scaler.run_once()
    assert _autoscale_series(scrape()) == []


def test_failed_reads_count_per_pool_and_drop_the_signals(cluster, epp, served, samples):
    kube, scaler, clock = cluster
    _, scrape = served
    epp.set([(0, 1, 0.1)])
    scaler.run_once()
    assert _of(scrape(), "kvgate_operator_autoscale_ready_endpoints") == 1
    scaler.metrics_port = 1  # nothing listens there
    for _ in range(2):
        clock[0] += 5
        scaler.run_once()
    got = scrape()
    pool = naming.name_of(samples["InferencePool"])
    assert got[("kvgate_operator_autoscale_epp_read_failures_total",
                (("namespace", "default"), ("pool", pool)))] == 2
    assert _of(got, "kvgate_operator_autoscale_scaling_active") == 0
    assert _of(got, "kvgate_operator_autoscale_desired_replicas") == 0  # the count stays
    assert _of(got, "kvgate_operator_autoscale_ready_endpoints") is None


def test_modelservers_over_the_cap_are_counted_not_exported(cluster, epp, served):
    kube, scaler, clock = cluster
    metrics, scrape = served
    metrics.autoscale.max_tracked = 1
    other = copy.deepcopy(kube.stored("ModelServer", "demo-llm"))
    other["metadata"] = {"name": "demo-llm-b", "namespace": "default"}
    kube.put(other)
    epp.set([], held=1)
    scaler.run_once()
    got = scrape()
    assert len({dict(labels)["modelserver"] for _, labels in _autoscale_series(got)
                if "modelserver" in dict(labels)}) == 1
    assert got[("kvgate_operator_autoscale_untracked_modelservers", ())] == 1


def test_a_standby_clears_its_series_and_the_leader_exports_again(samples, epp, served):
    """Only the leader looks: a replica that stops leading withdraws its series at once (Reconciler.set_leading),
    and so does a stopped autoscaler; leading again, the next look exports afresh."""
    metrics, scrape = served
    kube = MemoryKube()
    pool = kube.put(samples["InferencePool"])
    ms = copy.deepcopy(samples["ModelServer"])
    ms["spec"].update(replicas=0, minReplicas=0, maxReplicas=4)
    kube.put(ms)
    kube.put(_ready_pod("demo-pool-epp-1", naming.selector_labels("epp", naming.name_of(pool))))
    reconciler = Reconciler(kube, OperatorConfig("img", "img", "envoy"), metrics.autoscale)
    reconciler.autoscaler.metrics_port = epp.port
    epp.set([], held=1)
    reconciler.autoscaler.run_once()
    assert _of(scrape(), "kvgate_operator_autoscale_desired_replicas") == 1
    metrics.set_leader(False, transition=True)
    reconciler.set_leading(False)
    got = scrape()
    assert _autoscale_series(got) == [] and got[("kvgate_operator_leader", ())] == 0
    reconciler.set_leading(True)
    reconciler.autoscaler.run_once()
    assert _of(scrape(), "kvgate_operator_autoscale_desired_replicas") == 1
    reconciler.autoscaler.stop()  # never started: stopping only withdraws the series
    assert _autoscale_series(scrape()) == []
