"""The operator's work queue: the keys waiting to be reconciled, and the backoff of the ones that failed.

client-go's rate-limited work queue in small: a key is queued once however often it is added while it waits, a
failed key comes back after an exponential delay (1 s doubling to 60 s, or the delay its error asks for), and a
key that succeeds, or fails for good, starts its backoff over (`forget`). One consumer takes the keys.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import defaultdict

RETRY_FIRST_S = 1.0
RETRY_MAX_S = 60.0


def backoff_delay(attempt: int) -> float:
    """The delay before retry number `attempt` (1, 2, ...): RETRY_FIRST_S doubling up to RETRY_MAX_S."""
    doublings = min(attempt - 1, 32)  # capped: past RETRY_MAX_S anyway, and 2.0 ** 1024 would overflow
    return min(RETRY_MAX_S, RETRY_FIRST_S * 2.0 ** doublings)


class WorkQueue:
    """Keys to reconcile: deduplicated while waiting, delayed retries kept in a heap (at most one per key: the
    earliest), one consumer."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._ready: list[tuple] = []
        self._queued: set[tuple] = set()
        self._delayed: list[tuple[float, tuple]] = []
        self._due: dict[tuple, float] = {}  # key -> when its one pending retry is due; heap entries not here are stale
        self._attempts: dict[tuple, int] = defaultdict(int)  # key -> its failures in a row
        self._stopped = False

    def add(self, key: tuple, delay_s: float = 0.0) -> None:
        with self._cond:
            if delay_s > 0:
                due = time.monotonic() + delay_s
                if self._due.get(key, float("inf")) <= due:
                    return  # a retry is already due sooner
                self._due[key] = due
                heapq.heappush(self._delayed, (due, key))
            elif key not in self._queued:
                self._queued.add(key)
                self._ready.append(key)
            self._cond.notify()

    def retry(self, key: tuple, delay_s: float | None = None) -> tuple[float, int]:
        """Queue `key` again after `delay_s`, or after its backoff when None; (the delay, its failures in a row)."""
        with self._cond:
            self._attempts[key] += 1
            attempt = self._attempts[key]
        delay = delay_s if delay_s is not None else backoff_delay(attempt)
        self.add(key, delay)
        return delay, attempt

    def forget(self, key: tuple) -> None:
        """Start `key`'s backoff over: it succeeded, or failed in a way no retry mends."""
        with self._cond:
            self._attempts.pop(key, None)

    def pending_retries(self) -> dict[tuple, float]:
        """Keys waiting for a retry, and in how many seconds it is due."""
        with self._cond:
            now = time.monotonic()
            return {key: due - now for key, due in self._due.items()}

    def get(self) -> tuple | None:
        """The next key (None once stopped); waits for one."""
        with self._cond:
            while not self._stopped:
                now = time.monotonic()
                while self._delayed and self._delayed[0][0] <= now:
                    due, key = heapq.heappop(self._delayed)
                    if self._due.get(key) != due:
                        continue  # replaced by an earlier retry
                    del self._due[key]
                    if key not in self._queued:
                        self._queued.add(key)
                        self._ready.append(key)
                if self._ready:
                    key = self._ready.pop(0)
                    self._queued.discard(key)
                    return key
                timeout = (self._delayed[0][0] - now) if self._delayed else None
                self._cond.wait(timeout)
            return None

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
