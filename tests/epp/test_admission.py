"""Saturation detection and shedding of sheddable (priority < 0) requests."""

import pytest

from kvgate.epp.admission import Admission
from kvgate.epp.scheduling.config import SaturationConfig
from tests.epp.helpers import request, state

A, B = "10.0.0.1:8000", "10.0.0.2:8000"


def test_no_endpoints_is_saturated():
    assert Admission().is_saturated([])


def test_one_fresh_endpoint_with_headroom_is_enough():
    assert not Admission().is_saturated([state(A, queue=9, kv=0.95), state(B, queue=4, kv=0.79)])


@pytest.mark.parametrize("queue, kv", [(5, 0.0), (0, 0.8), (7, 0.99)])
def test_thresholds_are_inclusive(queue, kv):
    assert Admission(queue_depth_threshold=5, kv_cache_threshold=0.8).is_saturated([state(A, queue=queue, kv=kv)])


def test_stale_endpoints_count_as_saturated():
    admission = Admission()
    assert admission.is_saturated([state(A, stale=True), state(B, queue=6)])
    assert not admission.is_saturated([state(A, stale=True), state(B)])


def test_only_sheddable_requests_are_rejected_when_saturated():
    admission = Admission()
    saturated, idle = [state(A, queue=10)], [state(A)]
    assert not admission.admit(request(priority=-1), saturated)
    assert admission.admit(request(priority=-1), idle)
    assert admission.admit(request(priority=0), saturated)
    assert admission.admit(request(priority=5), [])


def test_from_config_and_validation():
    admission = Admission.from_config(SaturationConfig(queue_depth_threshold=2, kv_cache_util_threshold=0.5))
    assert admission.is_saturated([state(A, queue=2)]) and admission.is_saturated([state(A, kv=0.5)])
    assert not admission.is_saturated([state(A, queue=1, kv=0.4)])
    with pytest.raises(ValueError):
        Admission(queue_depth_threshold=0)
    with pytest.raises(ValueError):
        Admission(kv_cache_threshold=1.5)


def test_requests_routed_since_the_scrape_count_in_the_queue():
    admission = Admission(queue_depth_threshold=5)
    states = [state(A, queue=3), state(B, queue=4)]
    assert not admission.is_saturated(states, [1, 0])  # 4 < 5 on A
    assert admission.is_saturated(states, [2, 1])  # 5 and 5: no headroom anywhere
    assert not admission.admit(request(priority=-1), states, [2, 1])
    assert admission.admit(request(priority=0), states, [2, 1])
