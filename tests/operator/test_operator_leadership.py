"""Operator high availability without a cluster: the fence on writes (fencing.py), the reconciler's worker gated
by leadership (reconciler.py set_leading), and two replicas electing over a real Lease store (the file-backed
CoordinationV1Api of epp/file_lease.py) with a standby taking over from a leader that died (leadership.py).
The rig's API server and a SIGKILLed leader pod: tests/e2e/test_operator_ha_e2e.py."""

import argparse
import threading
import time
import urllib.request

import pytest

from kvgate.common.errors import ConfigError
from kvgate.epp.file_lease import FileLeaseApi
from kvgate.operator.apply import MODELSERVER
from kvgate.operator.config import OperatorConfig
from kvgate.operator.fencing import FencedKube, NotLeader
from kvgate.operator.leadership import OperatorLeadership
from kvgate.operator.main import leader_election_namespace
from kvgate.operator.metrics import OperatorMetrics
from kvgate.operator.reconciler import Reconciler
from tests.operator.memory_kube import MemoryKube
from tests.procs import free_port

LEASE_S, RENEW_S, RETRY_S = 1.0, 0.6, 0.1
WAIT_S = 20.0  # bounded waits, generous for a loaded machine


class FencedMemoryKube(FencedKube, MemoryKube):
    """The in-memory store behind the operator's fence."""


def _wait(predicate, timeout=WAIT_S, step=0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


def _modelserver(name):
    return {"apiVersion": "kvgate.dev/v1alpha1", "kind": "ModelServer",
            "metadata": {"name": name, "namespace": "default"}, "spec": {}}


def _config_map(name):
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": "default",
            "labels": {"app.kubernetes.io/managed-by": "kvgate-operator"}}, "data": {"k": "v"}}


def test_the_fence_refuses_every_write_but_not_reads():
    leading = threading.Event()
    kube = FencedMemoryKube(leading.is_set)
    kube.put(_modelserver("a"))
    assert [ms["metadata"]["name"] for ms in kube.list(MODELSERVER, "default")] == ["a"]
    with pytest.raises(NotLeader, match="does not hold the leader Lease"):
        kube.apply(_config_map("c"))
    assert ("configmaps", "default", "c") not in kube.objects
    leading.set()
    kube.apply(_config_map("c"))
    assert ("configmaps", "default", "c") in kube.objects
    leading.clear()
    with pytest.raises(NotLeader):
        kube.delete(kube.objects[("configmaps", "default", "c")])
    assert ("configmaps", "default", "c") in kube.objects


class RecordingKind:
    def __init__(self, fail_with=None):
        self.reconciled, self.reported, self.fail_with = [], [], fail_with

    def reconcile(self, ns, name):
        self.reconciled.append(name)
        if self.fail_with is not None:
            raise self.fail_with

    def report_failure(self, ns, name, failure):
        self.reported.append(name)


def _reconciler(kube, modelservers=None):
    reconciler = Reconciler(kube, OperatorConfig("e", "p", "v", resync_s=3600))
    reconciler.modelservers = modelservers or RecordingKind()
    reconciler.pools = RecordingKind()
    return reconciler


def test_a_standby_queues_keys_and_reconciles_everything_once_it_leads():
    kube = MemoryKube()
    kube.put(_modelserver("a"))
    kube.put(_modelserver("b"))
    reconciler = _reconciler(kube)
    reconciler.set_leading(False)
    reconciler.start()
    try:
        reconciler.queue.add(("ModelServer", "default", "a"))
        time.sleep(0.5)
        assert reconciler.modelservers.reconciled == []  # a standby's worker waits
        reconciler.set_leading(True)
        assert _wait(lambda: sorted(set(reconciler.modelservers.reconciled)) == ["a", "b"])  # "b" by ALL_KEY
    finally:
        reconciler.stop()


def test_a_write_refused_mid_reconcile_requeues_the_key_without_a_failure_condition():
    ms = RecordingKind(fail_with=NotLeader("PATCH /x: this operator replica does not hold the leader Lease"))
    reconciler = _reconciler(MemoryKube(), ms)
    key = ("ModelServer", "default", "a")
    delay = reconciler.process(key)
    assert delay is not None and delay <= 1.0
    assert key in reconciler.queue.pending_retries() and ms.reported == []


def _leader(metrics: OperatorMetrics) -> float | None:
    return metrics.registry.get_sample_value("kvgate_operator_leader")


def _replica(tmp_path, name, metrics=None):
    return OperatorLeadership(FileLeaseApi(tmp_path / "operator.lease"), "kvgate-system", name,
                              lease_duration=LEASE_S, renew_deadline=RENEW_S, retry_period=RETRY_S, metrics=metrics)


def test_a_standby_takes_over_a_dead_leader_within_lease_plus_retry(tmp_path):
    metrics_a, metrics_b = OperatorMetrics(), OperatorMetrics()
    a, b = _replica(tmp_path, "a", metrics_a), _replica(tmp_path, "b", metrics_b)
    rec_a, rec_b = _reconciler(MemoryKube()), _reconciler(MemoryKube())
    a.follow(rec_a)
    b.follow(rec_b)
    assert not rec_a.leading.is_set() and _leader(metrics_a) == 0  # nobody leads before the election
    a.start()
    try:
        assert _wait(a.may_write)
        b.start()
        time.sleep(5 * RETRY_S)
        assert not b.may_write() and not rec_b.leading.is_set() and rec_a.leading.is_set()
        a.elector.stop(release=False)  # the leader dies: it neither renews nor releases
        died = time.monotonic()
        assert _wait(b.may_write)
        took = time.monotonic() - died
        assert took < LEASE_S + RETRY_S + 5.0, took  # slack for a loaded machine
        assert rec_b.leading.is_set() and _leader(metrics_b) == 1
        assert not a.may_write()  # the dead leader's fence: past its renew deadline
    finally:
        b.stop()
        a.stop()
    assert not rec_b.leading.is_set()


def test_a_leader_that_stops_releases_and_the_standby_leads_at_its_next_try(tmp_path):
    a, b = _replica(tmp_path, "a"), _replica(tmp_path, "b")
    a.start()
    try:
        assert _wait(a.may_write)
        b.start()
        a.stop()  # SIGTERM: released
        stopped = time.monotonic()
        assert _wait(b.may_write)
        assert time.monotonic() - stopped < LEASE_S  # no lease to wait out
    finally:
        b.stop()
        a.stop()


def test_metrics_are_served_on_the_given_port():
    metrics = OperatorMetrics()
    port = free_port()
    metrics.serve("127.0.0.1", port)
    try:
        metrics.set_leader(True, transition=True)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "kvgate_operator_leader 1.0" in text and "kvgate_operator_leader_transitions_total 1.0" in text
    finally:
        metrics.close()


@pytest.mark.parametrize("flags, error", [
    (dict(leader_election_retry_period=12.0), "retry-period < "),
    (dict(leader_election_renew_deadline=20.0), "renew-deadline < "),
    (dict(leader_election_lease_duration=7200.0), "<= 3600"),
    (dict(namespace=None), "needs the Lease's namespace"),
])
def test_leader_election_flags_that_cannot_elect_are_refused(flags, error, monkeypatch):
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    args = argparse.Namespace(**{**dict(namespace="ns", leader_election_namespace=None,
                                        leader_election_lease_duration=15.0, leader_election_renew_deadline=10.0,
                                        leader_election_retry_period=2.0), **flags})
    with pytest.raises(ConfigError, match=error):
        leader_election_namespace(args)


def test_the_lease_namespace_comes_from_the_pod(monkeypatch):
    monkeypatch.setenv("POD_NAMESPACE", "kvgate-system")
    args = argparse.Namespace(namespace=None, leader_election_namespace=None, leader_election_lease_duration=15.0,
                              leader_election_renew_deadline=10.0, leader_election_retry_period=2.0)
    assert leader_election_namespace(args) == "kvgate-system"


@pytest.mark.parametrize("flags", [["--metrics-port", "0"], ["--metrics-port", "70000"],
                                   ["--leader-election-lease-name", "Not_A_Name"],
                                   ["--leader-election-lease-duration", "nan"],
                                   ["--leader-election-retry-period", "-1"]])
def test_out_of_range_flags_are_refused_by_the_parser(flags):
    from kvgate.cli import build_parser

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["operator", *flags])
    assert exit_info.value.code == 2
