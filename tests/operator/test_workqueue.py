"""The work queue's retry bookkeeping (workqueue.py): the backoff of a key that keeps failing, and its reset."""

from kvgate.operator.workqueue import RETRY_MAX_S, WorkQueue, backoff_delay


def test_backoff_doubles_from_one_second_up_to_a_minute():
    assert [backoff_delay(n) for n in range(1, 9)] == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    assert backoff_delay(5000) == RETRY_MAX_S  # a key failing for days: still the cap, no float overflow


def test_retry_counts_failures_in_a_row_until_forgotten():
    q = WorkQueue()
    key = ("ModelServer", "default", "a")
    assert q.retry(key) == (1.0, 1)
    assert q.retry(key) == (2.0, 2)
    assert q.retry(key, 7.0) == (7.0, 3)  # the error's own delay; it still counts as a failure
    assert q.retry(("Gateways",)) == (1.0, 1)  # per key
    assert set(q.pending_retries()) == {key, ("Gateways",)}
    assert 0.9 < q.pending_retries()[key] <= 1.0  # the earliest of its retries is the one kept
    q.forget(key)
    assert q.retry(key) == (1.0, 1)
