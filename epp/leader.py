"""Active-passive high availability in Kubernetes mode: a coordination.k8s.io/v1 Lease elects the EPP replica that
serves (`kvgate epp --ha-enable-leader-election`, upstream's flag and Lease name).

The election itself is common/lease_election.py (the operator's replicas use it too). What is the EPP's: the
Lease's name, and what leading means — the leader answers SERVING to Envoy's health check, followers keep their
state warm and answer NOT_SERVING. On stop (SIGTERM: a rollout or a deleted pod) the leader releases the Lease,
and the EPP keeps serving until it sees the successor's name on the Lease and Envoy had a health check's time to
find the successor ready (epp/shutdown.py hand_over), so that the gateway is never without a ready EPP.
"""

from __future__ import annotations

from kvgate.common.lease_election import (DEFAULT_LEASE_DURATION_S, DEFAULT_RENEW_DEADLINE_S,  # noqa: F401
                                          DEFAULT_RETRY_PERIOD_S, MAX_LEASE_DURATION_S, REQUEST_TIMEOUT,
                                          LeaseElector, default_identity, unusable_lease)


def lease_name(pool_namespace: str, pool_name: str) -> str:
    """Upstream's Lease name for a pool's EPP (one per pool: pools never share an election)."""
    return f"epp-{pool_namespace}-{pool_name}.gateway-api-inference-extension.sigs.k8s.io"
