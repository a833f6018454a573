"""Fencing: with leader election, only the operator replica that holds the Lease writes to the API server.

Every write (create, apply, status patch, delete: any method but GET) asks the gate first and raises NotLeader
when this replica does not hold the Lease by its own clock (common/lease_election.py holds_lease), so a leader
that lost its Lease stops writing at once, even inside a reconcile that was already running. Reads stay allowed:
a standby's lists keep it warm. NotLeader is a temporary failure (kopf's TemporaryError): the reconcile stops
there and its key waits for this replica to lead again, while the new leader reconciles everything from the
API server's state (reconciles are level-triggered and idempotent, so a half-done one is finished, not redone).
"""

from __future__ import annotations

from collections.abc import Callable

import kopf

from kvgate.operator.apply import Kube


class NotLeader(kopf.TemporaryError):
    """A write refused because this operator replica does not hold the leader Lease."""


class FencedKube(Kube):
    """Kube whose writes pass only while `may_write()` says this replica holds the Lease."""

    def __init__(self, may_write: Callable[[], bool], *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.may_write = may_write

    def _fence(self, method: str, path: str) -> None:
        if method != "GET" and not self.may_write():
            raise NotLeader(f"{method} {path}: this operator replica does not hold the leader Lease", delay=None)

    def request(self, method: str, path: str, body=None, **kwargs):
        self._fence(method, path)
        return super().request(method, path, body, **kwargs)

    def _once(self, method: str, path: str, body, query: list, content_type: str | None):
        self._fence(method, path)  # again per attempt: a write retried over seconds is checked before each try
        return super()._once(method, path, body, query, content_type)
