"""`oracle-placement`, a reference point for `kvgate bench routing`, not a router: where a fixed placement chosen
with the whole cell's requests known in advance puts the TTFT p90 of a shape — what a router that kept every prefix
group on one replica for good, with equal footprints everywhere, would get.

    group(r)  = the request's prefix group: its tenant (t3/u1 → t3) or conversation (c5/turn2 → c5); a request of
                no group (no-reuse: r17) is a group of its own
    rank      = groups by their request count in the cell, most first (ties: first seen first)
    replica   = the snake over the replicas (sorted by address) by rank: 0 1 2 3 3 2 1 0 0 1 ..., so each replica
                gets as many groups as the others and the busiest ones are spread
    one-off   = a group of one request goes round robin

The request is sent with the conformance header (`test-epp-endpoint-selection`), which the EPP's
header-based-testing-filter follows, so it takes Envoy's and the EPP's path like any other configuration's. It
sees the future (every group's request count) and nothing of the pool's state: it is neither a router nor the best
placement, only a fixed one without churn (`kvgate bench routing --workloads skewed-tenants,hot-tenant --configs
kvgate,oracle-placement`; docs/benchmarks.md). Where most requests are cached, the TTFT p90 of any placement sits
near one cold prefill of the shape's longest shared prompt.
Uniform pools only: the snake gives every replica the same share.
"""

from __future__ import annotations

from collections import Counter

from kvgate.bench.routing.workloads import BenchRequest


def group_of(key: str) -> str:
    """t3/u1 → t3, c5/turn2 → c5, r17 → r17."""
    return key.split("/", 1)[0]


def snake(rank: int, replicas: int) -> int:
    """0 1 2 3 3 2 1 0 0 1 2 3 ... for 4 replicas."""
    lap, at = divmod(rank, replicas)
    return at if lap % 2 == 0 else replicas - 1 - at


def placement(requests: list[BenchRequest], endpoints: list[str]) -> list[str]:
    """The endpoint (host:port) each request is sent to, in request order."""
    if not endpoints:
        raise ValueError("oracle placement needs the pool's endpoints")
    ordered = sorted(endpoints)
    counts = Counter(group_of(r.key) for r in requests)
    ranks = {g: i for i, (g, n) in enumerate(counts.most_common()) if n > 1}
    out, one_off = [], 0
    for r in requests:
        rank = ranks.get(group_of(r.key))
        if rank is None:
            out.append(ordered[one_off % len(ordered)])
            one_off += 1
        else:
            out.append(ordered[snake(rank, len(ordered))])
    return out
