"""Which endpoints a request may go to: the director over a real (unstarted) Datalayer."""

import time

from kvgate.epp.admission import Admission
from kvgate.epp.datalayer import Datalayer
from kvgate.epp.datalayer.collector import FAILURES_OUT_OF_ROTATION
from kvgate.epp.datastore import Datastore
from kvgate.epp.director import Director, RoutingError
from kvgate.epp.scheduling.config import default_config
from kvgate.epp.scheduling.framework import Scheduler
from kvgate.epp.types import Endpoint, EndpointMetrics
from tests.epp.helpers import addresses, request

import pytest

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"


def director(trust_pool_readiness=False):
    layer = Datalayer()
    layer.set_endpoints([Endpoint(a) for a in (A, B, C)])
    return Director(Datastore(), layer, Scheduler(default_config().scheduler), Admission(), seed=1,
                    trust_pool_readiness=trust_pool_readiness), layer


def scraped(layer, address, age=0.0, failures=0):
    """As if the collector had scraped `address` `age` seconds ago, then failed `failures` times in a row."""
    c = layer._collectors[address]
    c.metrics = EndpointMetrics(updated_at=time.monotonic() - age)
    c.scrapes += 1
    c.consecutive_failures = failures


def test_unscraped_endpoints_get_no_request_in_standalone_mode():
    d, layer = director()
    assert d.candidates(None) == []
    with pytest.raises(RoutingError) as err:
        d.pick(request())
    assert err.value.status == 503 and "ready" in str(err.value)
    scraped(layer, B)
    assert addresses(d.candidates(None)) == [B]


def test_kubernetes_mode_trusts_pod_readiness_when_nothing_answers_scrapes():
    d, layer = director(trust_pool_readiness=True)
    assert sorted(addresses(d.candidates(None))) == [A, B, C]  # metric-less servers (echo backends) still routed
    scraped(layer, C)
    assert addresses(d.candidates(None)) == [C]  # once any answers, the unscraped ones wait for their scrape


def test_failing_and_stale_endpoints():
    d, layer = director()
    scraped(layer, A)
    scraped(layer, B, failures=FAILURES_OUT_OF_ROTATION)  # answered once, now failing: out
    scraped(layer, C, age=60.0)  # old numbers, but not failing: a fallback only
    assert addresses(d.candidates(None)) == [A]
    scraped(layer, A, age=60.0)
    assert sorted(addresses(d.candidates(None))) == [A, C]  # every available one is stale: degrade, not stop
    assert addresses(d.candidates([C])) == [C]
    assert d.candidates([B]) == []
