"""The file lease (epp/file_lease.py): the API server's Lease semantics over a JSON file, so that the unchanged
LeaseElector (epp/leader.py) elects one EPP among replicas on one machine (`kvgate epp --ha-lease-file`)."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import stat
import subprocess
import threading
import time
from datetime import datetime, timedelta, timezone

import httpx
import pytest
from kubernetes.client import V1Lease, V1LeaseSpec, V1ObjectMeta
from kubernetes.client.rest import ApiException

from kvgate.epp.file_lease import MAX_LEASE_FILE_BYTES, FileLeaseApi
from kvgate.epp.leader import LeaseElector
from kvgate.stack.local_stack import epp_ready
from tests.procs import KVGATE, free_port, stop_group

NAME, NS = "epp-lease", "standalone"
LEASE_S, RENEW_S, RETRY_S = 1.0, 0.6, 0.1


def new_lease(holder: str) -> V1Lease:
    return V1Lease(metadata=V1ObjectMeta(name=NAME, namespace=NS),
                   spec=V1LeaseSpec(holder_identity=holder, lease_duration_seconds=3, lease_transitions=0))


def status_of(call) -> int:
    with pytest.raises(ApiException) as info:
        call()
    return info.value.status


def test_read_create_replace_with_the_api_servers_answers(tmp_path):
    api = FileLeaseApi(tmp_path / "epp.lease")
    assert status_of(lambda: api.read_namespaced_lease(NAME, NS)) == 404
    assert status_of(lambda: api.replace_namespaced_lease(NAME, NS, new_lease("a"))) in (404, 422)
    api.create_namespaced_lease(NS, new_lease("a"), _request_timeout=(2.0, 5.0))
    assert stat.S_IMODE(os.stat(tmp_path / "epp.lease").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "epp.lease.lock").st_mode) == 0o600
    assert status_of(lambda: api.create_namespaced_lease(NS, new_lease("b"))) == 409  # AlreadyExists
    assert status_of(lambda: api.read_namespaced_lease("other", NS)) == 404

    first = api.read_namespaced_lease(NAME, NS)
    second = FileLeaseApi(tmp_path / "epp.lease").read_namespaced_lease(NAME, NS)
    assert first.spec.holder_identity == "a" and first.metadata.resource_version == "1"
    first.spec.holder_identity = "a2"
    written = api.replace_namespaced_lease(NAME, NS, first)
    assert written.metadata.resource_version == "2"
    second.spec.holder_identity = "b"  # read before the write: stale
    assert status_of(lambda: api.replace_namespaced_lease(NAME, NS, second)) == 409
    assert api.read_namespaced_lease(NAME, NS).spec.holder_identity == "a2"


def test_compare_and_swap_loses_no_write(tmp_path):
    """Threads (each its own lock descriptor) increment a counter by read-and-replace, retrying on 409: every
    successful replace counts, none is lost to a race."""
    FileLeaseApi(tmp_path / "epp.lease").create_namespaced_lease(NS, new_lease("x"))
    done = [0] * 4

    def work(i: int) -> None:
        api = FileLeaseApi(tmp_path / "epp.lease")
        while done[i] < 25:
            lease = api.read_namespaced_lease(NAME, NS)
            lease.spec.lease_transitions += 1
            try:
                api.replace_namespaced_lease(NAME, NS, lease)
                done[i] += 1
            except ApiException as e:
                assert e.status == 409

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert FileLeaseApi(tmp_path / "epp.lease").read_namespaced_lease(NAME, NS).spec.lease_transitions == 100


def electors(path, n: int = 2) -> list[LeaseElector]:
    return [LeaseElector(FileLeaseApi(path), NAME, NS, f"epp-{i}", lambda leading: None, lease_duration=LEASE_S,
                         renew_deadline=RENEW_S, retry_period=RETRY_S) for i in range(n)]


def wait_leaders(es, count: int, timeout_s: float) -> list[LeaseElector]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [e for e in es if e.leading]
        assert len(found) <= 1, [e.identity for e in found]
        if len(found) == count:
            return found
        time.sleep(0.01)
    raise AssertionError(f"not {count} leader(s) within {timeout_s} s: {[e.identity for e in es if e.leading]}")


def test_one_leads_a_silent_leader_is_replaced_after_the_lease_a_released_one_at_once(tmp_path):
    es = electors(tmp_path / "epp.lease")
    try:
        for e in es:
            e.start()
        (first,) = wait_leaders(es, 1, 3)
        time.sleep(5 * RETRY_S)
        assert [e for e in es if e.leading] == [first]  # the follower keeps trying and keeps failing
        (other,) = [e for e in es if e is not first]

        silent_at = time.monotonic()
        first._stop.set()  # dies: renews no more, releases nothing
        first._thread.join(5)
        wait_leaders([other], 1, LEASE_S + 2)
        takeover = time.monotonic() - silent_at
        assert LEASE_S - 2 * RETRY_S <= takeover <= LEASE_S + 3 * RETRY_S + 0.5, takeover

        third = electors(tmp_path / "epp.lease", 3)[2]  # a new candidate, then the leader stops and releases
        third.start()
        time.sleep(3 * RETRY_S)
        assert not third.leading
        released_at = time.monotonic()
        other.stop(release=True)
        wait_leaders([third], 1, 2)
        assert time.monotonic() - released_at < 2 * RETRY_S + 0.5
        lease = FileLeaseApi(tmp_path / "epp.lease").read_namespaced_lease(NAME, NS)
        assert lease.spec.holder_identity == third.identity and lease.spec.lease_transitions == 2
        es.append(third)
    finally:
        for e in es:
            e.stop(release=False)


@pytest.mark.parametrize("content", [b"{not json", b'{"name": "x"}', b"\xff\xfe", b" " * (MAX_LEASE_FILE_BYTES + 1),
                                     b"[]", b"[" * 2000 + b"]" * 2000])  # the last: nested past json's stack
def test_a_corrupt_or_oversized_file_elects_nobody_and_crashes_nothing(tmp_path, content, caplog):
    path = tmp_path / "epp.lease"
    path.write_bytes(content)
    api = FileLeaseApi(path)
    with pytest.raises(ApiException) as info:
        api.read_namespaced_lease(NAME, NS)
    assert info.value.status == 500 and "unusable" in info.value.reason and str(path) in info.value.reason
    es = electors(path)
    try:
        for e in es:
            e.start()
        time.sleep(5 * RETRY_S)
        assert not any(e.leading for e in es) and all(e._thread.is_alive() for e in es)
        assert "unusable" in caplog.text  # said, not swallowed
        path.unlink()  # the operator removes it: an election starts
        wait_leaders(es, 1, 3)
    finally:
        for e in es:
            e.stop(release=False)


def write_record(path, holder: str, duration, renew: datetime, transitions: int = 0) -> None:
    """A valid record, as another writer left it (renamed into place, as the file lease writes)."""
    tmp = path.with_name(path.name + ".rogue")
    tmp.write_text(json.dumps({"name": NAME, "namespace": NS, "holderIdentity": holder,
                               "leaseDurationSeconds": duration, "acquireTime": renew.isoformat(),
                               "renewTime": renew.isoformat(), "leaseTransitions": transitions,
                               "resourceVersion": "7"}))
    os.replace(tmp, path)


@pytest.mark.parametrize("duration, ahead_s, says", [
    (999_999_999_999, 0, "longer than the 3600 s"),
    (-5, 0, "is negative"),
    (15, 10 * 365 * 86400, "ahead of this replica's clock"),
])
def test_a_record_with_an_absurd_timing_is_reported_and_taken_over(tmp_path, caplog, duration, ahead_s, says):
    """Such a record held the election for ever (or, negative, was refused as corrupt): the electors report it and
    one takes it over at once; leaseTransitions at int32's top, which no replace could advance, counts again."""
    path = tmp_path / "epp.lease"
    write_record(path, "intruder", duration, datetime.now(timezone.utc) + timedelta(seconds=ahead_s), 2**31 - 1)
    es = electors(path)
    try:
        with caplog.at_level(logging.WARNING, logger="kvgate.common.lease_election"):
            for e in es:
                e.start()
            (leader,) = wait_leaders(es, 1, 5 * RETRY_S + 1)
        lease = FileLeaseApi(path).read_namespaced_lease(NAME, NS)
        assert lease.spec.holder_identity == leader.identity and lease.spec.lease_duration_seconds == int(LEASE_S)
        assert lease.spec.lease_transitions == 1
        reports = [r.getMessage() for r in caplog.records if "is unusable" in r.getMessage()]
        assert 1 <= len(reports) <= len(es) and all("'intruder'" in r and says in r for r in reports), reports
    finally:
        for e in es:
            e.stop(release=False)


def test_an_absurd_record_written_again_and_again_is_reported_once_per_elector(tmp_path, caplog):
    """A writer that keeps putting its record back (a new renewTime each time): every elector takes it over each
    time it sees it, and logs it once (at most once a minute for the same holder and field), not once a try."""
    path = tmp_path / "epp.lease"
    es = electors(path)
    stop = threading.Event()

    def rogue() -> None:
        while not stop.wait(0.02):
            write_record(path, "intruder", 999_999_999_999, datetime.now(timezone.utc))

    writer = threading.Thread(target=rogue)
    try:
        with caplog.at_level(logging.WARNING, logger="kvgate.common.lease_election"):
            writer.start()
            for e in es:
                e.start()
            time.sleep(20 * RETRY_S)
            stop.set()
            writer.join(5)
            # each elector took the rogue's record over as it saw it: one that took it over earlier learns at its
            # next renew (a retry period, later on a loaded machine) that another holds it now
            settle = time.monotonic() + 5
            while time.monotonic() < settle and sum(e.leading for e in es) != 1:
                time.sleep(0.02)
            wait_leaders(es, 1, 3)  # the writer gone, one leads
        reports = [r for r in caplog.records if "held by 'intruder' is unusable" in r.getMessage()]
        assert 1 <= len(reports) <= len(es), [r.getMessage() for r in reports]
    finally:
        stop.set()
        for e in es:
            e.stop(release=False)


def test_a_leader_whose_file_turns_corrupt_steps_down_after_its_renew_deadline(tmp_path):
    path = tmp_path / "epp.lease"
    es = electors(path, 1)
    try:
        es[0].start()
        wait_leaders(es, 1, 3)
        broke_at = time.monotonic()
        path.write_text("garbage")
        wait_leaders(es, 0, RENEW_S + 1)
        assert time.monotonic() - broke_at >= RENEW_S - RETRY_S
    finally:
        es[0].stop(release=False)


def test_a_symlink_or_a_directory_is_refused(tmp_path):
    (tmp_path / "target").write_text("{}")
    os.symlink(tmp_path / "target", tmp_path / "link.lease")
    (tmp_path / "dir.lease").mkdir()
    for name in ("link.lease", "dir.lease"):
        assert status_of(lambda: FileLeaseApi(tmp_path / name).read_namespaced_lease(NAME, NS)) == 500


def start_epp(tmp_path, i: int, lease: str):
    ports = [free_port() for _ in range(3)]
    log = open(tmp_path / f"epp{i}.log", "wb")
    proc = subprocess.Popen(
        [KVGATE, "--log-level", "info", "epp", "--endpoints-file", str(tmp_path / "endpoints"),
         "--grpc-port", str(ports[0]), "--grpc-health-port", str(ports[1]), "--metrics-port", str(ports[2]),
         "--ha-enable-leader-election", "--ha-lease-file", lease, "--ha-lease-duration", "2s",
         "--ha-renew-deadline", "1.5s", "--ha-retry-period", "0.25s"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return proc, ports[1], ports[2]  # the process, its health and metrics ports


def serving_gauge(metrics_port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    (value,) = re.findall(r"^kvgate_epp_serving (\S+)$", text, re.M)
    return float(value)


@pytest.mark.processes
def test_two_epp_processes_one_serves_and_the_follower_leads_when_it_is_killed(tmp_path):
    (tmp_path / "endpoints").write_text("")  # an empty pool: ready at once, no engine needed
    lease = str(tmp_path / "epp.lease")
    replicas = []
    try:
        for i in range(2):
            replicas.append(start_epp(tmp_path, i, lease))

        def serving() -> list[bool]:
            for i, (proc, *_) in enumerate(replicas):
                assert proc.poll() is None, (tmp_path / f"epp{i}.log").read_text()[-3000:]
            return [epp_ready(port) for _, port, _ in replicas]

        deadline = time.monotonic() + 60
        while sorted(serving()) != [False, True]:
            assert time.monotonic() < deadline, serving()
            time.sleep(0.1)
        time.sleep(1.0)  # four retry periods: still one
        states = serving()
        assert sorted(states) == [False, True]
        leader, follower = replicas[states.index(True)], replicas[states.index(False)]
        # the active replica shows on /metrics too (the dashboard's "Active EPP replica")
        assert [serving_gauge(metrics_port) for *_, metrics_port in replicas] == [float(s) for s in states]
        killed_at = time.monotonic()
        os.kill(leader[0].pid, signal.SIGKILL)
        leader[0].wait(10)
        while not epp_ready(follower[1]):
            assert time.monotonic() - killed_at < 6, "the follower never led"
            time.sleep(0.05)
        assert 1.0 <= time.monotonic() - killed_at < 6
    finally:
        for proc, *_ in replicas:
            stop_group(proc)


@pytest.mark.parametrize("flags, says", [
    (["--ha-enable-leader-election"], "--ha-lease-file PATH"),
    (["--ha-lease-file", "x.lease"], "needs --ha-enable-leader-election"),
    (["--ha-enable-leader-election", "--ha-lease-file", "/nonexistent-dir/x.lease"], "no directory"),
    (["--ha-enable-leader-election", "--ha-lease-file", "x.lease", "--ha-lease-duration", "61m"], "<= 3600s"),
])
def test_flag_validation(flags, says):
    from kvgate.cli import build_parser

    args = build_parser().parse_args(["epp", "--endpoints", "127.0.0.1:1", *flags])
    with pytest.raises(SystemExit) as info:
        args.func(args)
    assert says in str(info.value.code)
