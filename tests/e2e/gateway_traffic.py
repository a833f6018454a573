"""What the e2e tests that change a Gateway's routes under load share: the HTTPRoute's pool references, closed-loop
completions through the Gateway's Envoy, Envoy's admin counters per pool, and the timing of a change.

A change is timed from the API write to the last request Envoy sent to the pool it left (its cluster's
`upstream_rq_total` stops growing for `quiet_s`; polled every 50 ms at Envoy's admin) and to the first one to the
pool it moved to.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import httpx

ENVOY_SELECTOR = "app.kubernetes.io/name=kvgate-gateway,app.kubernetes.io/instance=inference-gateway"
ADMIN_PORT = 19000  # kvgate.operator.gateway.ADMIN_PORT: on the rig, the pod's own address
XDS_CLUSTER = "kvgate-xds"  # the bootstrap's cluster of the operator's xDS server
QUIET_S = 2.0  # how long a pool's counter must stay still to count as left

# The sample pool stays in the route on a path of its own: the engines' NetworkPolicy admits the Gateways whose
# routes use the ModelServer's pool (other pools selecting the same pods are not the ModelServer's).
KEEP_RULE = {"matches": [{"path": {"type": "Exact", "value": "/kvgate-e2e/keep"}}],
             "backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "demo-pool"}]}


def pool_ref(pool: str, weight: int) -> dict:
    return {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool, "weight": weight}


def set_route_refs(client, route_res, namespace: str, *refs: dict, route: str = "demo-route") -> None:
    """The sample HTTPRoute's first rule sent to `refs`, the sample pool kept on KEEP_RULE's path."""
    current = client.get(route_res, route, namespace)
    current["spec"]["rules"][0]["backendRefs"] = list(refs)
    current["spec"]["rules"][1:] = [KEEP_RULE]
    client.replace(route_res, current, namespace)


def completion(http: httpx.Client, ip: str) -> httpx.Response:
    return http.post(f"http://{ip}:8080/v1/completions", json={"model": "demo", "prompt": "Hello", "max_tokens": 2})


class ClosedLoopLoad:
    """`clients` keep-alive clients, each sending the next completion to the Envoy at `ip` as the last one ends.
    `outcomes` holds (status code or exception name, the answer's start when not 200)."""

    def __init__(self, ip: str, clients: int = 2) -> None:
        self.ip, self.outcomes = ip, []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def _run(self) -> None:
        with httpx.Client(timeout=30) as http:
            while not self._stop.is_set():
                try:
                    r = completion(http, self.ip)
                    self.outcomes.append((r.status_code, "" if r.status_code == 200 else r.text[:120]))
                except httpx.HTTPError as exc:
                    self.outcomes.append((type(exc).__name__, str(exc)[:120]))

    def start(self) -> ClosedLoopLoad:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=40)

    def failed(self, since: int = 0) -> list[tuple]:
        return [o for o in self.outcomes[since:] if o[0] != 200]


class EnvoyAdmin:
    """Envoy's admin endpoint of a Gateway pod: counters per pool cluster and of the xDS stream."""

    def __init__(self, ip: str, namespace: str) -> None:
        self.namespace = namespace
        self.http = httpx.Client(base_url=f"http://{ip}:{ADMIN_PORT}", timeout=5)

    def stat(self, name: str) -> int:
        text = self.http.get("/stats", params={"filter": f"^{name}$"}).text
        return int(text.split(": ")[1]) if ": " in text else 0

    def requests_to(self, pool: str) -> int:
        return self.stat(f"cluster.pool-{self.namespace}-{pool}.upstream_rq_total")

    def connected(self) -> bool:
        return self.stat("control_plane.connected_state") == 1

    def xds_connections(self) -> int:
        """Connections Envoy opened to the operator's xDS server so far."""
        return self.stat(f"cluster.{XDS_CLUSTER}.upstream_cx_total")

    def has_pool(self, pool: str) -> bool:
        """Whether Envoy's config holds a cluster of `pool` (a cluster lingers a while after its routes left)."""
        return f"pool-{self.namespace}-{pool}::" in self.http.get("/clusters").text

    def rejected(self) -> str:
        """Envoy's xDS update_rejected counters that are not 0 (empty when it took every update)."""
        text = self.http.get("/stats", params={"filter": "update_rejected$"}).text
        return "\n".join(line for line in text.strip().splitlines() if not line.endswith(": 0"))


def switch(admin: EnvoyAdmin, load: ClosedLoopLoad, write: Callable[[], None], left: str, to: str,
           limit_s: float = 60, quiet_s: float = QUIET_S) -> tuple[float, float, int]:
    """(seconds to the last request to pool `left`, seconds to the first to `to`, requests meanwhile) of write()."""
    before_left, before_to, before_n = admin.requests_to(left), admin.requests_to(to), len(load.outcomes)
    began = time.monotonic()
    write()
    last_left, first_to, still_since = began, None, time.monotonic()
    while time.monotonic() - still_since < quiet_s:
        assert time.monotonic() - began < limit_s, f"traffic never left {left}"
        now_left, now_to = admin.requests_to(left), admin.requests_to(to)
        if now_left != before_left:
            before_left, last_left, still_since = now_left, time.monotonic(), time.monotonic()
        if first_to is None and now_to != before_to:
            first_to = time.monotonic()
        time.sleep(0.05)
    assert first_to is not None, f"no request reached {to}; answers meanwhile: {load.outcomes[before_n:][-5:]}"
    return last_left - began, first_to - began, len(load.outcomes) - before_n
