"""The chaos suite, shortened, as a user runs it: `kvgate bench chaos --short` injects every fault into local sim
stacks (kvgate's Envoy and the stock upstream-shaped one) under 32 streams, and each row must hold its
expectation (bench/chaos/runner.py `verdict`). The same command, full length, is the chaos bench itself."""

from __future__ import annotations

import json
import subprocess

import pytest

from kvgate.bench.chaos.runner import LEADER_RECOVER_S, SCENARIOS
from tests.procs import KVGATE

pytestmark = [pytest.mark.processes, pytest.mark.slow]


@pytest.fixture(scope="module")
def chaos(tmp_path_factory):
    result = tmp_path_factory.mktemp("chaos") / "chaos.json"
    run = subprocess.run([KVGATE, "bench", "chaos", "--short", "--faults", ",".join(s.name for s in SCENARIOS),
                          "--result-file", str(result)], capture_output=True, text=True, timeout=900)
    rows = {r["fault"]: r for r in json.loads(result.read_text())["faults"]} if result.exists() else {}
    return run, rows


def test_every_fault_holds_its_expectation(chaos):
    run, rows = chaos
    assert set(rows) == {s.name for s in SCENARIOS}, run.stdout + run.stderr[-3000:]
    broken = {name: r for name, r in rows.items() if not r["passed"]}
    assert not broken and run.returncode == 0, run.stdout


def test_a_dead_replica_costs_only_what_it_was_running(chaos):
    _, rows = chaos
    # Out of rotation within 1 s of the kill; after an engine-loop death the server first notices and exits.
    for name, out_of_rotation_s in (("replica-kill", 1.0), ("engine-loop-kill", 2.0)):
        r = rows[name]
        assert r["failed_not_on_victim"] == 0, r  # nothing else lost: retried on the next endpoint
        assert r["out_of_rotation_s"] is not None and r["out_of_rotation_s"] <= out_of_rotation_s, r
        assert r["recover_s"] is not None, r  # restarted (as `kvgate up` does) and back in rotation
    assert rows["replica-drain"]["failed"] == 0, rows["replica-drain"]  # SIGTERM: its streams finish
    for name in ("replica-kill-default", "replica-kill-upstream"):  # one endpoint a decision: no retry, but
        assert rows[name]["out_of_rotation_s"] <= 1.0, rows[name]  # out of rotation within a second


def test_the_epp_going_away(chaos):
    _, rows = chaos
    assert rows["epp-drain-failopen"]["failed"] == 0, rows["epp-drain-failopen"]  # a rollout loses nothing
    assert rows["epp-kill-failopen"]["recover_s"] is not None
    assert rows["epp-kill-failopen"]["failed"] <= 32  # at most the streams it carried: new ones fail open
    assert rows["epp-kill-failclose"]["recover_s"] is not None  # refused while it is away, served once back
    # Two EPPs over a file lease: the follower (not the killed leader, restarted) leads once the lease runs out
    leader = rows["epp-leader-kill"]
    assert leader["recover_s"] is not None and leader["recover_s"] <= LEADER_RECOVER_S, leader
    # Two EPPs serving at once: only what the killed one carried breaks (plus at most one request per worker sent
    # to it before Envoy ejected it); Envoy ejects it at once and takes its restarted process back
    both = rows["epp-kill-active-active"]
    assert both["victim_in_flight"] is not None and both["failed"] <= both["victim_in_flight"] + 32, both
    assert both["out_of_rotation_s"] is not None and both["out_of_rotation_s"] <= 1.0, both
    assert both["recover_s"] is not None, both


def test_kv_event_floods_and_rogues_cost_nothing(chaos):
    _, rows = chaos
    for name in ("kv-replay-flood", "kv-rogue-publisher"):
        r = rows[name]
        assert r["failed"] == 0 and r["kv_batches_after_fault"] > 0, r  # the EPP kept reading engine events
        assert r["hit_rate_after"] >= r["hit_rate_before"] - 0.15, r  # and routing kept the cache hits
