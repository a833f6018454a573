"""The precise scorer's per-request holds (epp/prefix/request_holds.py), on a PreciseIndex with a fake clock."""

from kvgate.epp.prefix.precise_index import Delta, PreciseIndex
from kvgate.epp.prefix.request_holds import RequestHolds

A, B = "10.0.0.1:8000", "10.0.0.2:8000"


def setup(ttl=1.0, max_hold_s=10.0, max_speculative=100):
    now = [0.0]
    index = PreciseIndex(speculative_ttl_s=ttl, max_speculative=max_speculative, clock=lambda: now[0])
    return now, index, RequestHolds(index, max_hold_s)


def test_a_hold_lasts_until_the_response_ends_then_the_ttl():
    now, index, holds = setup()
    holds.hold("r1", [1, 2, 3], A)
    assert len(holds) == 1 and holds.blocks == 3 and index.held_size() == 3
    now[0] = 9.0
    assert index.match([1, 2, 3]) == {A: 3}
    holds.end("r1")
    holds.end("r1")  # twice: nothing left to release
    assert len(holds) == 0 and holds.blocks == 0 and index.held_size() == 0
    now[0] = 9.9
    assert index.match([1, 2, 3]) == {A: 3}
    now[0] = 10.1
    assert index.match([1, 2, 3]) == {}


def test_a_retry_replaces_the_requests_hold():
    now, index, holds = setup()
    holds.hold("r1", [1, 2], A)
    holds.hold("r1", [1, 2], B)
    assert len(holds) == 1 and holds.blocks == 2
    assert index.match([1, 2]) == {A: 2, B: 2}  # A's blocks were released: they count for the TTL
    now[0] = 1.1
    assert index.match([1, 2]) == {B: 2}


def test_holds_run_out_at_max_hold_and_the_oldest_go_past_the_budget():
    now, index, holds = setup(max_hold_s=10.0, max_speculative=4)
    holds.hold("r1", [1, 2, 3], A)
    now[0] = 10.5
    holds.sweep()  # ran out at 10 s: the TTL counts from there
    assert len(holds) == 0 and index.match([1, 2, 3]) == {A: 3}
    now[0] = 11.1
    assert index.match([1, 2, 3]) == {}
    holds.hold("r2", [1, 2, 3], A)
    holds.hold("r3", [7, 8, 9], A)  # 6 held blocks > 4: r2 released now
    assert len(holds) == 1 and holds.blocks == 3 and index.held_size() == 3
    now[0] = 12.2
    assert index.match([1, 2, 3]) == {} and index.match([7, 8, 9]) == {A: 3}


def test_forgetting_an_endpoint_drops_its_requests_and_events_confirm_blocks():
    now, index, holds = setup()
    index.watch(A, 1)
    holds.hold("r1", [1, 2], A)
    holds.hold("r2", [5], B)
    index.apply(Delta(A, 1, added={1: None, 2: None}))  # confirmed: the events decide from now on
    assert index.held_size() == 1
    index.remove(B)
    holds.forget_endpoint(B)
    assert len(holds) == 1 and holds.blocks == 2
    holds.end("r1")
    assert holds.blocks == 0 and index.match([1, 2]) == {A: 2} and index.speculative_size() == 0
