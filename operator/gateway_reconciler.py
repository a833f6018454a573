"""The Gateways reconciler: every Gateway of the operator's classes becomes its Envoy, and the Gateway API
statuses follow.

All Gateways at once, one key: an HTTPRoute may attach to several Gateways and an InferencePool be used by
several, and their status.parents need every Gateway's answer. Per reconcile: the GatewayClasses' Accepted; per
Gateway its routing (gateway.py), its Envoy ConfigMap, Deployment and Service, its status; then each HTTPRoute's
and InferencePool's parents entries of the operator. A Gateway that fails does not stop the others: a temporary
failure retries the key once all were tried, a permanent one is the Gateway's Programmed=False condition.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import kopf

from kvgate.epp.datastore import pool_endpoints
from kvgate.operator import naming
from kvgate.operator.apply import (CONFIGMAP, GATEWAY, GATEWAYCLASS, HTTPROUTE, NAMESPACE, POD, POOL, REFERENCEGRANT,
                                   SERVICE, ApiError, Kube, NameConflict, describe)
from kvgate.operator.conditions import condition, stamp
from kvgate.operator.config import OperatorConfig
from kvgate.operator.epp_pod_address import routing_via_epp_pods
from kvgate.operator.failures import REASON as FAILED, PermanentFailureLog, classify, failure_message
from kvgate.operator.gateway import (GatewayRouting, desired_envoy_objects, gateway_status, gatewayclass_status,
                                     httproute_status, is_our_class, render_config, routes_for_gateway)
from kvgate.operator.pool import (epp_ref, is_fail_open, pool_status, response_needs, returns_lists,
                                  running_epp_config)
from kvgate.operator.spec_shape import pool_problems
from kvgate.operator.xds.envoy_status import envoys_programmed

log = logging.getLogger("kvgate.operator")

# The operator's EPP ConfigMaps: a pool's EPP config says whether the EPP answers with lists (returns_lists) and
# what of a response it reads (response_needs).
_EPP_CONFIGMAPS = f"app.kubernetes.io/component=epp,{naming.MANAGED_BY_KEY}={naming.MANAGED_BY}"


class GatewayReconciler:
    def __init__(self, kube: Kube, config: OperatorConfig, failure_log: PermanentFailureLog) -> None:
        self.kube, self.config, self.failure_log = kube, config, failure_log

    def reconcile(self) -> None:
        ns = self.config.namespace
        classes = [gc for gc in self.kube.list(GATEWAYCLASS) if is_our_class(gc) and not naming.is_deleting(gc)]
        for gc in classes:
            self.kube.patch_status(gc, gatewayclass_status(gc))
        class_names = {naming.name_of(gc) for gc in classes}
        gateways = [g for g in self.kube.list(GATEWAY, ns)
                    if (g.get("spec") or {}).get("gatewayClassName") in class_names and not naming.is_deleting(g)]
        routes = self.kube.list(HTTPROUTE, ns)
        pools = [p for p in self.kube.list(POOL, ns) if not pool_problems(p)]  # a misshapen one: as if absent
        services = self.kube.list(SERVICE, ns)
        grants = self.kube.list(REFERENCEGRANT, ns)
        namespaces = self._namespace_labels()
        pods = PodCache(self.kube)
        # Pools whose EPP (the operator's) answers with lists get override_host routes retrying over the list.
        epp_configs = {naming.key_of(cm): cm for cm in self.kube.list(CONFIGMAP, ns, label_selector=_EPP_CONFIGMAPS)}
        running = {naming.key_of(pool): running_epp_config(
            epp_configs.get((naming.namespace_of(pool), naming.epp_name(pool))), pool) for pool in pools}  # one parse
        fallback_pools = frozenset(key for key, config in running.items() if returns_lists(config))
        # What of a response each pool's EPP reads: its routes send it no more.
        pool_response_needs = {key: response_needs(config) for key, config in running.items()}
        endpoints = {}
        for pool in pools:  # FailOpen's cluster, and an override_host cluster's hosts (other pools use none)
            if is_fail_open(pool) or naming.key_of(pool) in fallback_pools:
                endpoints[naming.key_of(pool)] = [e.address for e in
                                                  pool_endpoints(pool, pods.of(naming.namespace_of(pool)))]

        route_parents: dict[tuple[str, str], list[dict]] = defaultdict(list)
        pool_gateways: dict[tuple[str, str], list[dict]] = defaultdict(list)
        failed = []
        for gw in gateways:
            routing = GatewayRouting([], {}, [], {})  # what the status shows if the routes cannot be computed
            try:
                routing = routes_for_gateway(gw, routes, pools, services, grants, endpoints, namespaces,
                                             fallback_pools, pool_response_needs)
                if self.config.epp_address_mode == "pod-ip":
                    routing = routing_via_epp_pods(routing, services, pods.of)
                self._program(gw, routing, pods)
            except NameConflict as exc:  # permanent until the user acts: a condition, no retry loop
                log.warning("%s: %s", describe(gw), exc)
                self.kube.patch_status(gw, _not_programmed(gateway_status(gw, None, None, routing), gw, exc))
                continue
            except Exception as exc:
                failure = classify(exc)
                if isinstance(failure, kopf.TemporaryError):  # the other Gateways go on; then the key is retried
                    failed.append(f"{describe(gw)}: {failure}")
                    log.warning("%s: reconcile failed: %s", describe(gw), failure)
                    continue
                self.failure_log.log(("Gateway", *naming.key_of(gw)), failure)
                self.kube.patch_status(gw, _not_programmed(gateway_status(gw, None, None, routing), gw, failure))
                continue
            self.failure_log.clear(("Gateway", *naming.key_of(gw)))
            for key, entries in routing.route_parents.items():
                route_parents[key] += entries
            for key in routing.pools_used:
                pool_gateways[key].append(gw)

        self._write_parents(routes, route_parents, pools, pool_gateways, services)
        if failed:
            raise kopf.TemporaryError("; ".join(failed), delay=None)

    def _program(self, gw: dict, routing: GatewayRouting, pods: "PodCache") -> None:
        """Apply the Gateway's Envoy objects for `routing`, then its status."""
        previous = self.kube.get(CONFIGMAP, naming.envoy_name(gw), naming.namespace_of(gw))
        tracing = self.config.tracing.envoy() if self.config.tracing is not None else None
        xds = self.config.envoy_xds()
        applied = [self.kube.apply(o) for o in
                   desired_envoy_objects(gw, render_config(gw, routing, tracing, xds), self.config.envoy_image,
                                         self.config.envoy_service_type,
                                         previous if naming.is_owned_by(previous, gw) else None,
                                         bind_pod_ip=self.config.envoy_bind_address == "pod-ip")]
        config_map = next(o for o in applied if o.get("kind") == "ConfigMap")
        deployment = next(o for o in applied if o.get("kind") == "Deployment")
        service = next(o for o in applied if o.get("kind") == "Service")
        programmed = envoys_programmed(self.kube, gw, config_map, pods.of(naming.namespace_of(gw))) if xds else None
        self.kube.patch_status(gw, gateway_status(gw, deployment, service, routing, xds=programmed))

    def _write_parents(self, routes: list[dict], route_parents: dict, pools: list[dict], pool_gateways: dict,
                       services: list[dict]) -> None:
        """The operator's status.parents entries of each HTTPRoute and pool that has (or had) some."""
        for route in routes:
            ours = route_parents.get(naming.key_of(route), [])
            if ours or _ours((route.get("status") or {}).get("parents")):
                self.kube.patch_status(route, httproute_status(route, ours))
        svc_by_key = {naming.key_of(s): s for s in services}
        for pool in pools:
            using = pool_gateways.get(naming.key_of(pool), [])
            if using or _ours((pool.get("status") or {}).get("parents")):
                svc = svc_by_key.get((naming.namespace_of(pool), epp_ref(pool).get("name", "")))
                self.kube.patch_status(pool, pool_status(pool, using, svc))

    def _namespace_labels(self) -> dict[str, dict]:
        try:
            return {naming.name_of(n): (n.get("metadata") or {}).get("labels") or {} for n in self.kube.list(NAMESPACE)}
        except ApiError as exc:
            if exc.status != 403:  # a namespaced operator may not read namespaces: selectors then match none
                raise
            return {}


class PodCache:
    """Pods per namespace, listed at most once per reconcile."""

    def __init__(self, kube: Kube) -> None:
        self.kube, self._by_ns = kube, {}

    def of(self, ns: str) -> list[dict]:
        if ns not in self._by_ns:
            self._by_ns[ns] = self.kube.list(POD, ns)
        return self._by_ns[ns]


def _ours(entries: list[dict] | None) -> bool:
    return any(e.get("controllerName") == naming.CONTROLLER_NAME for e in entries or [])


def _not_programmed(status: dict, gateway: dict, exc: Exception) -> dict:
    """A Gateway status whose Programmed condition says why its objects are not (all) applied: which of their
    names is taken (NameConflict), or the permanent failure (ReconcileFailed)."""
    gen = (gateway.get("metadata") or {}).get("generation")
    reason = exc.reason if isinstance(exc, NameConflict) else FAILED
    message = str(exc) if isinstance(exc, NameConflict) else failure_message(exc)
    programmed = condition("Programmed", False, reason, message, gen)
    conds = [c for c in status["conditions"] if c["type"] != "Programmed"]
    return {**status, "conditions": conds + stamp([programmed], (gateway.get("status") or {}).get("conditions"))}
