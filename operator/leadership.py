"""Operator high availability: several operator replicas, one leader elected over a coordination.k8s.io/v1 Lease
(`kvgate operator --leader-election enabled`; the election is common/lease_election.py, as the EPP's).

Every replica runs its watches, so a standby's view is warm; only the leader's worker reconciles (reconciler.py
set_leading) and only while it holds the Lease may it write (fencing.py, checked before every write). When the
leader dies, a standby takes the Lease once the leader has not renewed it for the lease duration (by the standby's
own clock), at its next try: the takeover bound is lease duration + retry period (17 s with the defaults, 15 s
and 2 s). It then reconciles everything again, finishing whatever the old leader left half done: names are
deterministic and objects owned by what they were made for, so nothing is made twice or left behind. A leader
that cannot renew for the renew deadline (10 s) stops writing at once (its fence) and steps down at its next
round; the deadline is shorter than the lease, so two replicas never write together as far as their clocks
agree on a few seconds. A leader that stops (SIGTERM: a rollout, a drained node) releases the Lease, and a
standby takes over one retry period later.
"""

from __future__ import annotations

import threading

from kvgate.common.lease_election import LeaseElector

OPERATOR_LEASE_NAME = "kvgate-operator"


class OperatorLeadership:
    """One replica's side of the election: the elector, the reconciler it gates (each reactor restart makes a
    new one: `follow`), and the leader gauge."""

    def __init__(self, api, namespace: str, identity: str, *, lease_name: str = OPERATOR_LEASE_NAME,
                 lease_duration: float, renew_deadline: float, retry_period: float, metrics=None) -> None:
        self._lock = threading.Lock()
        self._reconciler = None
        self.metrics = metrics
        self.elector = LeaseElector(api, lease_name, namespace, identity, self._on_change,
                                    lease_duration=lease_duration, renew_deadline=renew_deadline,
                                    retry_period=retry_period)
        if metrics is not None:
            metrics.set_leader(False)

    def may_write(self) -> bool:
        """The fence: whether this replica holds the Lease now (by its own clock)."""
        return self.elector.holds_lease()

    def follow(self, reconciler) -> None:
        """Gate `reconciler` by the election from now on (before its worker starts)."""
        with self._lock:
            self._reconciler = reconciler
            reconciler.set_leading(self.elector.leading)

    def _on_change(self, leading: bool) -> None:
        with self._lock:
            if self._reconciler is not None:
                self._reconciler.set_leading(leading)
        if self.metrics is not None:
            self.metrics.set_leader(leading, transition=True)

    def start(self) -> None:
        self.elector.start()

    def stop(self) -> None:
        """Stop trying, and release the Lease if held (a standby takes over at its next try)."""
        with self._lock:
            if self._reconciler is not None:
                self._reconciler.set_leading(False)
        self.elector.stop(release=True)
