"""The decision path over a scrape round: the datalayer's round snapshot and the director using it, so that the
scheduler's per-snapshot caches hold between requests."""

import time

from kvgate.epp.admission import Admission
from kvgate.epp.datalayer import Datalayer
from kvgate.epp.datastore import Datastore
from kvgate.epp.director import Director
from kvgate.epp.scheduling.config import default_config
from kvgate.epp.scheduling.framework import Scheduler
from kvgate.epp.types import Endpoint
from tests.epp.helpers import request

A, B = "10.0.0.1:8000", "10.0.0.2:8000"


def test_round_snapshot_is_kept_for_an_interval_and_rebuilt_after():
    layer = Datalayer(interval=0.05)
    layer.set_endpoints([Endpoint(A), Endpoint(B)])
    calls = []

    def counts():
        calls.append(1)
        return {A: (3, 300)}

    first = layer.snapshot(counts)
    assert layer.snapshot(counts) is first and len(calls) == 1  # same round: same objects, counts read once
    assert (first[0].in_flight_requests, first[0].in_flight_tokens) == (3, 300)
    time.sleep(0.06)
    later = layer.snapshot(counts)
    assert later is not first and len(calls) == 2


def test_round_snapshot_follows_a_changed_endpoint_set_at_once():
    layer = Datalayer(interval=60)
    layer.set_endpoints([Endpoint(A)])
    assert [s.address for s in layer.snapshot()] == [A]
    layer.set_endpoints([Endpoint(A), Endpoint(B)])
    assert [s.address for s in layer.snapshot()] == [A, B]


def test_director_decisions_in_one_round_share_the_schedulers_snapshot():
    layer = Datalayer(interval=60)
    layer.set_endpoints([Endpoint(A), Endpoint(B)])
    scheduler = Scheduler(default_config().scheduler)
    # Never scraped: routable only as a Kubernetes pool's Ready pods (this test is about snapshots, not readiness).
    director = Director(Datastore(), layer, scheduler, Admission(), trust_pool_readiness=True)
    director.pick(request(request_id="1"))
    snapshot = scheduler.primary._snapshot
    director.pick(request(request_id="2"))
    assert scheduler.primary._snapshot is snapshot
    # The subset hint narrows the same state objects: a new list, but no new states.
    picked = director.pick(request(request_id="3"), subset=[B])
    assert [s.address for s in picked] == [B] and picked[0] in snapshot.endpoints
    # Metrics gauges read exact in-flight counts; the round's snapshot still has the counts it was built with.
    exact = {s.address: s.in_flight_requests for s in director.states()}
    assert sum(exact.values()) == 3 and exact[B] >= 1
    assert sum(s.in_flight_requests for s in snapshot.endpoints) == 0
