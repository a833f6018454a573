"""EPP leader election (epp/leader.py) against the rig's real API server: coordination.k8s.io/v1 Leases, three
candidates with short timings. Exactly one leads; a leader that stops (SIGTERM) releases the Lease and a follower
takes over within a retry period; a leader that dies without releasing is replaced once its lease runs out, not
before."""

from __future__ import annotations

import time

import pytest

from kvgate.epp.leader import LeaseElector, lease_name

pytestmark = pytest.mark.e2e
LEASE_S, RENEW_S, RETRY_S = 3.0, 2.0, 0.25


def leaders(electors):
    return [e for e in electors if e.leading]


def wait_one_leader(electors, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = leaders(electors)
        if len(found) == 1:
            return found[0]
        assert len(found) <= 1, [e.identity for e in found]
        time.sleep(0.02)
    raise AssertionError(f"no single leader within {timeout_s}s: {[e.identity for e in leaders(electors)]}")


def test_one_leader_release_on_stop_and_takeover_after_a_crash(k8s, namespace):
    from kubernetes import client, config

    api = client.CoordinationV1Api(config.new_client_from_config(config_file=str(k8s.kubeconfig)))
    name = lease_name(namespace, "pool")
    changes = []
    electors = [LeaseElector(api, name, namespace, f"epp-{i}", lambda leading, i=i: changes.append((i, leading)),
                             lease_duration=LEASE_S, renew_deadline=RENEW_S, retry_period=RETRY_S)
                for i in range(3)]
    try:
        for e in electors:
            e.start()
        first = wait_one_leader(electors, timeout_s=5)
        time.sleep(2 * RETRY_S)
        assert leaders(electors) == [first]  # the followers keep trying and keep failing
        lease = api.read_namespaced_lease(name, namespace)
        assert lease.spec.holder_identity == first.identity

        stopped_at = time.monotonic()
        first.stop(release=True)  # SIGTERM: releases
        rest = [e for e in electors if e is not first]
        second = wait_one_leader(rest, timeout_s=3)
        handover = time.monotonic() - stopped_at
        assert handover < 2 * RETRY_S + 1.0, handover

        crashed_at = time.monotonic()
        second._stop.set()  # dies: renews no more, releases nothing
        second._thread.join(timeout=10)
        third = wait_one_leader([e for e in rest if e is not second], timeout_s=LEASE_S + 3)
        takeover = time.monotonic() - crashed_at
        print(f"handover after release {handover:.2f}s; takeover after a crash {takeover:.2f}s (lease {LEASE_S}s)")
        assert LEASE_S - 2 * RETRY_S <= takeover <= LEASE_S + 3 * RETRY_S + 1.0, takeover
        assert api.read_namespaced_lease(name, namespace).spec.lease_transitions >= 2
        assert third.leading
    finally:
        for e in electors:
            e.stop(release=True)


def test_a_lease_with_an_absurd_duration_is_reported_and_taken_over(k8s, namespace, caplog):
    """A Lease someone else wrote with leaseDurationSeconds 2^31 - 1 (the most the API server stores) and a fresh
    renewTime held the election for 68 years: the candidates log it as unusable and one takes it over at once."""
    import logging
    from datetime import datetime, timezone

    from kubernetes import client, config

    api = client.CoordinationV1Api(config.new_client_from_config(config_file=str(k8s.kubeconfig)))
    name = lease_name(namespace, "pool")
    now = datetime.now(timezone.utc)
    api.create_namespaced_lease(namespace, client.V1Lease(
        metadata=client.V1ObjectMeta(name=name, namespace=namespace),
        spec=client.V1LeaseSpec(holder_identity="intruder", lease_duration_seconds=2**31 - 1, acquire_time=now,
                                renew_time=now, lease_transitions=0)))
    electors = [LeaseElector(api, name, namespace, f"epp-{i}", lambda leading: None, lease_duration=LEASE_S,
                             renew_deadline=RENEW_S, retry_period=RETRY_S) for i in range(2)]
    try:
        with caplog.at_level(logging.WARNING, logger="kvgate.common.lease_election"):
            for e in electors:
                e.start()
            leader = wait_one_leader(electors, timeout_s=4 * RETRY_S + 2)
        lease = api.read_namespaced_lease(name, namespace)
        assert lease.spec.holder_identity == leader.identity and lease.spec.lease_duration_seconds == int(LEASE_S)
        assert "intruder" in caplog.text and "is unusable" in caplog.text and "longer than" in caplog.text
    finally:
        for e in electors:
            e.stop(release=True)
