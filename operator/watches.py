"""What the operator watches, and which keys each watch event queues (reconciler.py says what a key does).

Only `@kopf.on.event` handlers, and each only enqueues keys: they keep no state on the objects (no kopf
annotations, no finalizers), so deleting a ModelServer, pool or Gateway is never blocked by the operator being
down, and the garbage collector removes what the operator made through the owner references on every object.
"""

from __future__ import annotations

import logging
import threading

import kopf

from kvgate.operator import naming
from kvgate.operator.network_policy import route_refs
from kvgate.operator.reconciler import GATEWAYS_KEY, Reconciler
from kvgate.operator.spec_shape import pool_ref_name

log = logging.getLogger("kvgate.operator")

# Label this on a ConfigMap named by a pool's kvgate.dev/epp-config and a change to it rolls out at once; an
# unlabelled one is picked up at the next reconcile of its pools (every resync).
CONFIG_LABEL = "kvgate.dev/epp-config"
_MANAGED_SELECTOR = f"{naming.MANAGED_BY_KEY}={naming.MANAGED_BY}"
# Filters the API server applies to kopf's watches (the handlers' label filters alone run in the operator,
# after every object of the kind was sent to it): only the operator's own objects and labelled ConfigMaps.
SERVER_SIDE_SELECTORS = {
    ("apps", "v1", "deployments"): _MANAGED_SELECTOR,
    ("", "v1", "services"): _MANAGED_SELECTOR,
    ("networking.k8s.io", "v1", "networkpolicies"): _MANAGED_SELECTOR,
    ("", "v1", "configmaps"): CONFIG_LABEL,
}


class RouteIndex:
    """What each HTTPRoute referenced when last seen: the pools and Gateways of its refs. A route event then
    wakes the pools it references and the ones it stopped referencing (their NetworkPolicies follow), and a
    Gateway event the pools behind that Gateway's routes. Only keys, a few per route."""

    def __init__(self) -> None:
        self._refs: dict[tuple[str, str], tuple[set, set]] = {}
        self._lock = threading.Lock()

    def update(self, key: tuple[str, str], route: dict | None) -> set[tuple[str, str]]:
        """Record `route` (None: deleted); the pools it references now or did before."""
        with self._lock:
            before = self._refs.pop(key, (set(), set()))[0]
            if route is None:
                return before
            self._refs[key] = route_refs(route)
            return before | self._refs[key][0]

    def pools_behind(self, gateway_key: tuple[str, str]) -> set[tuple[str, str]]:
        with self._lock:
            return {pool for pools, gateways in self._refs.values() if gateway_key in gateways for pool in pools}


def register(registry, reconciler: Reconciler):
    """Register the watch handlers on a kopf OperatorRegistry; each only enqueues keys."""
    q = reconciler.queue
    managed = {naming.MANAGED_BY_KEY: naming.MANAGED_BY}
    routes = RouteIndex()

    @kopf.on.event("kvgate.dev", "v1alpha1", "modelservers", registry=registry)
    def modelserver_event(body, namespace, name, **_):
        q.add(("ModelServer", namespace, name))
        pool_name = pool_ref_name(body)
        if pool_name:
            q.add(("InferencePool", namespace, pool_name))

    @kopf.on.event("inference.networking.k8s.io", "v1", "inferencepools", registry=registry)
    def pool_event(namespace, name, **_):
        q.add(("InferencePool", namespace, name))
        q.add(("PoolMembers", namespace, name))
        q.add(GATEWAYS_KEY)

    @kopf.on.event("gateway.networking.k8s.io", "v1", "httproutes", registry=registry)
    def httproute_event(event, body, namespace, name, **_):
        q.add(GATEWAYS_KEY)
        for pool_key in routes.update((namespace, name), None if event.get("type") == "DELETED" else body):
            q.add(("InferencePool", *pool_key))  # the EPP's NetworkPolicy admits the route's Gateways

    @kopf.on.event("gateway.networking.k8s.io", "v1", "gateways", registry=registry)
    def gateway_event(namespace, name, **_):
        q.add(GATEWAYS_KEY)
        for pool_key in routes.pools_behind((namespace, name)):
            q.add(("InferencePool", *pool_key))

    for group, version, plural in (("gateway.networking.k8s.io", "v1", "gatewayclasses"),
                                   ("gateway.networking.k8s.io", "v1beta1", "referencegrants")):
        @kopf.on.event(group, version, plural, registry=registry, id=f"{plural}_event")
        def gateway_api_event(**_):
            q.add(GATEWAYS_KEY)

    def owned_event(body, namespace, **_):
        for ref in (body.get("metadata") or {}).get("ownerReferences") or []:
            if ref.get("kind") == "ModelServer":
                q.add(("ModelServer", namespace, ref.get("name")))
                q.add(GATEWAYS_KEY)  # FailOpen (and override_host) clusters' endpoints follow the engine pods
            elif ref.get("kind") == "InferencePool":
                q.add(("InferencePool", namespace, ref.get("name")))  # put back what a user deleted
                q.add(GATEWAYS_KEY)  # the pool's ResolvedRefs; with pod-ip, the EPP's address
            elif ref.get("kind") == "Gateway":
                q.add(GATEWAYS_KEY)

    kopf.on.event("apps", "v1", "deployments", labels=managed, registry=registry,
                  id="deployments_event")(owned_event)
    kopf.on.event(group="", version="v1", plural="services", labels=managed, registry=registry,
                  id="services_event")(owned_event)
    if reconciler.config.network_policy:
        kopf.on.event("networking.k8s.io", "v1", "networkpolicies", labels=managed, registry=registry,
                      id="networkpolicies_event")(owned_event)

    @kopf.on.event(group="", version="v1", plural="configmaps", labels={CONFIG_LABEL: kopf.PRESENT},
                   registry=registry, id="configmaps_event")
    def config_event(namespace, name, **_):
        q.add(("ConfigUsers", namespace, name))

    @kopf.on.login(registry=registry)
    def login(**kwargs):  # a registry of our own gets no default login handler: use the kubernetes client's
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(registry=registry)
    def startup(settings: kopf.OperatorSettings, **_):
        settings.posting.level = logging.WARNING  # Kubernetes Events only for problems
        for resource, selector in SERVER_SIDE_SELECTORS.items():
            settings.watching.label_selectors[resource] = selector
        settings.watching.server_timeout = 300  # re-list now and then, as a belt to the resync's braces
        settings.watching.client_timeout = 330
        reconciler.start()
        reconciler.queue.add(GATEWAYS_KEY)
        log.info("kvgate operator started: namespace %s, epp-address-mode %s, resync every %.0fs",
                 reconciler.config.namespace or "(all)", reconciler.config.epp_address_mode,
                 reconciler.config.resync_s)

    @kopf.on.cleanup(registry=registry)
    def cleanup(**_):
        reconciler.stop()
        log.info("kvgate operator stopped")

    return registry
