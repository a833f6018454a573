"""Gateway API controller logic for GatewayClass controllerName kvgate.dev/gateway-controller.

A Gateway of our class becomes an Envoy Deployment + Service + ConfigMap; its config is rendered from the
HTTPRoutes attached to it (common/gateway_routes.py). Route and Gateway statuses use the Gateway API's standard
conditions and reasons.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Mapping
from typing import NamedTuple

from kvgate.common import bounded_json
from kvgate.common.envoy_config import RESPONSE_BODY, CircuitBreakers, EnvoyTracing, PoolBackend, RouteTimeouts
from kvgate.operator import naming
from kvgate.operator.conditions import condition, stamp
from kvgate.common.gateway_routes import RouteRule, ServiceBackend, WeightedBackend, hostname_covers
from kvgate.common.gateway_routes import BOOTSTRAP_FILE, CDS_FILE, eds_file, file_name, render_gateway_files
from kvgate.operator.pool import epp_ref, epp_service_port, is_fail_open
from kvgate.operator.xds.xds_files import ADS_SOURCE, XdsAddress, is_xds_file_set, xds_files

ADMIN_PORT = 19000
UNPRIVILEGED_OFFSET = 10000  # listener ports below 1024 are served on port+10000 in the (non-root) pod
HTTPROUTE_KIND = {"group": naming.GATEWAY_GROUP, "kind": "HTTPRoute"}


def is_our_class(gatewayclass: dict | None) -> bool:
    return bool(gatewayclass) and (gatewayclass.get("spec") or {}).get("controllerName") == naming.CONTROLLER_NAME


def gatewayclass_status(gc: dict, now: str | None = None) -> dict:
    gen = (gc.get("metadata") or {}).get("generation")
    accepted = condition("Accepted", True, "Accepted", f"handled by {naming.CONTROLLER_NAME}", gen)
    return {"conditions": stamp([accepted], (gc.get("status") or {}).get("conditions"), now)}


def container_port(listener_port: int) -> int:
    return listener_port if listener_port >= 1024 else listener_port + UNPRIVILEGED_OFFSET


# --- attaching routes to listeners ---------------------------------------------------------------------------

class GatewayRouting(NamedTuple):
    rules: list[RouteRule]  # what Envoy serves
    route_parents: dict[tuple[str, str], list[dict]]  # (ns, route) -> its status.parents entries for this Gateway
    pools_used: list[tuple[str, str]]  # (ns, pool) used by accepted routes: the pool's status.parents
    attached_routes: dict[str, int]  # listener name -> number of routes attached


def _refers_to(parent_ref: dict, route: dict, gateway: dict) -> bool:
    return (parent_ref.get("group", naming.GATEWAY_GROUP) == naming.GATEWAY_GROUP
            and parent_ref.get("kind", "Gateway") == "Gateway"
            and parent_ref.get("name") == naming.name_of(gateway)
            and parent_ref.get("namespace", naming.namespace_of(route)) == naming.namespace_of(gateway))


def _namespace_allowed(listener: dict, route_ns: str, gateway_ns: str, namespaces: dict[str, dict]) -> bool:
    allowed = ((listener.get("allowedRoutes") or {}).get("namespaces") or {})
    source = allowed.get("from", "Same")
    if source == "All":
        return True
    if source == "Selector":
        wanted = (allowed.get("selector") or {}).get("matchLabels") or {}
        labels = namespaces.get(route_ns) or {}
        return bool(wanted) and all(labels.get(k) == v for k, v in wanted.items())
    return route_ns == gateway_ns


def _kind_allowed(listener: dict) -> bool:
    kinds = (listener.get("allowedRoutes") or {}).get("kinds")
    return not kinds or any(k.get("kind") == "HTTPRoute" and k.get("group", naming.GATEWAY_GROUP)
                            == naming.GATEWAY_GROUP for k in kinds)


def effective_hostnames(listener_hostname: str | None, route_hostnames: list[str]) -> list[str]:
    """The hostnames a route serves on a listener: the intersection of both; [] when they are disjoint."""
    if not listener_hostname:
        return list(route_hostnames) or ["*"]
    if not route_hostnames:
        return [listener_hostname]
    out = []
    for h in route_hostnames:
        if hostname_covers(listener_hostname, h):
            out.append(h)
        elif hostname_covers(h, listener_hostname):
            out.append(listener_hostname)
    return sorted(set(out))


def _http_listeners(gateway: dict) -> list[dict]:
    return [l for l in (gateway.get("spec") or {}).get("listeners") or [] if l.get("protocol") == "HTTP"]


def _match_listeners(parent_ref: dict, route: dict, gateway: dict,
                     namespaces: dict[str, dict]) -> tuple[list[tuple[dict, list[str]]], dict | None]:
    """Listeners (with effective hostnames) the route attaches to via this parentRef, or a failed Accepted."""
    candidates = [l for l in _http_listeners(gateway)
                  if parent_ref.get("sectionName") in (None, l.get("name"))
                  and parent_ref.get("port") in (None, l.get("port"))]
    if not candidates:
        return [], condition("Accepted", False, "NoMatchingParent", "no HTTP listener matches the parentRef's "
                             "sectionName/port")
    allowed = [l for l in candidates if _kind_allowed(l)
               and _namespace_allowed(l, naming.namespace_of(route), naming.namespace_of(gateway), namespaces)]
    if not allowed:
        return [], condition("Accepted", False, "NotAllowedByListeners",
                             "the listeners' allowedRoutes do not admit this route")
    hostnames = (route.get("spec") or {}).get("hostnames") or []
    attached = [(l, effective_hostnames(l.get("hostname"), hostnames)) for l in allowed]
    attached = [(l, hs) for l, hs in attached if hs]
    if not attached:
        return [], condition("Accepted", False, "NoMatchingListenerHostname",
                             "no listener hostname intersects the route's hostnames")
    return attached, None


# --- resolving backendRefs -----------------------------------------------------------------------------------

def _grant_allows(grants: list[dict], route: dict, target_ns: str, group: str, kind: str, name: str) -> bool:
    for grant in grants:
        if naming.namespace_of(grant) != target_ns:
            continue
        spec = grant.get("spec") or {}
        from_ok = any(f.get("group") == naming.GATEWAY_GROUP and f.get("kind") == "HTTPRoute"
                      and f.get("namespace") == naming.namespace_of(route) for f in spec.get("from") or [])
        to_ok = any(t.get("group", "") == group and t.get("kind") == kind and t.get("name") in (None, "", name)
                    for t in spec.get("to") or [])
        if from_ok and to_ok:
            return True
    return False


class Lookups(NamedTuple):
    pools: dict[tuple[str, str], dict]
    services: dict[tuple[str, str], dict]
    grants: list[dict]
    pool_endpoints: dict[tuple[str, str], list[str]]
    fallback_pools: frozenset[tuple[str, str]] = frozenset()
    response_needs: Mapping[tuple[str, str], str] | None = None  # per pool; absent: RESPONSE_BODY


# Per-pool Envoy limits, as annotations on the InferencePool (its schema is upstream's): unset or invalid values
# keep the defaults of kvgate.common.envoy_config (CircuitBreakers; the listener's 300 s stream-idle timeout).
BREAKER_ANNOTATIONS = {f"kvgate.dev/{name.replace('_', '-')}": name
                       for name in ("max_requests", "max_pending_requests", "max_connections", "max_retries")}
STREAM_IDLE_ANNOTATION = "kvgate.dev/stream-idle-timeout"  # a Gateway API duration, e.g. "15m"


def _pool_limits(pool: dict) -> tuple[CircuitBreakers, float | None]:
    annotations = (pool.get("metadata") or {}).get("annotations") or {}
    breakers = {}
    for key, name in BREAKER_ANNOTATIONS.items():
        value = str(annotations.get(key, ""))
        if value.isdigit() and int(value) > 0:
            breakers[name] = int(value)
    return CircuitBreakers(**breakers), parse_gateway_duration(annotations.get(STREAM_IDLE_ANNOTATION))


def pool_backend(pool: dict, services: dict[tuple[str, str], dict], endpoints: list[str],
                 fallbacks: bool = False, response: str = RESPONSE_BODY) -> PoolBackend:
    """The Envoy view of a pool: its EPP Service's DNS name, its endpoints, EPP health port, Envoy limits."""
    ns = naming.namespace_of(pool)
    svc_name = epp_ref(pool).get("name", "")
    svc = services.get((ns, svc_name)) or {}
    svc_ports = [p.get("port") for p in (svc.get("spec") or {}).get("ports") or []]
    # Health-check over gRPC only where the Service exposes the EPP's health port (ours does; a user's EPP
    # Service may expose only the ext-proc port, and Envoy then checks that port's TCP socket).
    health = naming.EPP_HEALTH_PORT if naming.EPP_HEALTH_PORT in svc_ports else None
    breakers, stream_idle_s = _pool_limits(pool)
    return PoolBackend(name=f"{ns}-{naming.name_of(pool)}", epp_host=f"{svc_name}.{ns}.svc.cluster.local",
                       epp_port=epp_service_port(pool), endpoints=sorted(endpoints),
                       failure_mode_allow=is_fail_open(pool), epp_health_port=health,
                       app_protocol=(pool.get("spec") or {}).get("appProtocol") or "http",
                       circuit_breakers=breakers, stream_idle_s=stream_idle_s, fallbacks=fallbacks,
                       response=response)


_DURATION = re.compile(r"^(?:[0-9]{1,5}(?:h|m|s|ms)){1,4}$")  # the Gateway API's Duration (GEP-2257)
_DURATION_PART = re.compile(r"([0-9]+)(h|ms|m|s)")
_UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


def parse_gateway_duration(value) -> float | None:
    """A Gateway API duration ("10s", "1h30m", "500ms") in seconds; None when unset or not one, so that a bad
    value keeps kvgate's default. (The EPP config's parse_duration takes Go durations and numbers, and raises.)"""
    if not isinstance(value, str) or not _DURATION.match(value):
        return None
    return sum(int(n) * _UNIT_S[unit] for n, unit in _DURATION_PART.findall(value))


def rule_timeouts(rule: dict) -> RouteTimeouts:
    """An HTTPRoute rule's `timeouts` (request, backendRequest), else kvgate's defaults (RouteTimeouts)."""
    timeouts = rule.get("timeouts") or {}
    request = parse_gateway_duration(timeouts.get("request"))
    backend = parse_gateway_duration(timeouts.get("backendRequest"))
    default = RouteTimeouts()
    return RouteTimeouts(request_s=default.request_s if request is None else request,
                         backend_request_s=backend if backend else None)  # "0s": no per-try limit


def resolve_backend(ref: dict, route: dict, look: Lookups) -> tuple[PoolBackend | ServiceBackend | None, dict | None]:
    """(backend, None) or (None, a failed ResolvedRefs condition) for one backendRef."""
    group, kind = ref.get("group", ""), ref.get("kind", "Service")
    ns, name = ref.get("namespace", naming.namespace_of(route)), ref.get("name", "")
    if (group, kind) not in ((naming.INFERENCE_GROUP, "InferencePool"), ("", "Service")):
        return None, condition("ResolvedRefs", False, "InvalidKind", f"unsupported backendRef kind {group}/{kind}")
    if ns != naming.namespace_of(route) and not _grant_allows(look.grants, route, ns, group, kind, name):
        return None, condition("ResolvedRefs", False, "RefNotPermitted",
                               f"no ReferenceGrant in {ns!r} allows a reference to {kind} {name!r}")
    if kind == "InferencePool":
        pool = look.pools.get((ns, name))
        if pool is None:
            return None, condition("ResolvedRefs", False, "BackendNotFound", f"InferencePool {ns}/{name} not found")
        return pool_backend(pool, look.services, look.pool_endpoints.get((ns, name), []),
                            fallbacks=(ns, name) in look.fallback_pools,
                            response=(look.response_needs or {}).get((ns, name), RESPONSE_BODY)), None
    svc, port = look.services.get((ns, name)), ref.get("port")
    if svc is None:
        return None, condition("ResolvedRefs", False, "BackendNotFound", f"Service {ns}/{name} not found")
    if port not in [p.get("port") for p in (svc.get("spec") or {}).get("ports") or []]:
        return None, condition("ResolvedRefs", False, "BackendNotFound", f"Service {ns}/{name} has no port {port}")
    return ServiceBackend(f"{ns}-{name}-{port}", f"{name}.{ns}.svc.cluster.local", int(port)), None


def _route_rules(route: dict, look: Lookups) -> tuple[list[tuple[list[WeightedBackend], list[dict], RouteTimeouts]],
                                                      dict, set]:
    """Per rule: (weighted backends, matches, timeouts); the ResolvedRefs condition; the pools the route uses."""
    failures, rules, pools = [], [], set()
    for rule in (route.get("spec") or {}).get("rules") or []:
        backends = []
        for ref in rule.get("backendRefs") or []:
            backend, failed = resolve_backend(ref, route, look)
            if failed:
                failures.append(failed)
            elif isinstance(backend, PoolBackend):
                pools.add((ref.get("namespace", naming.namespace_of(route)), ref["name"]))
            backends.append(WeightedBackend(backend, int(ref.get("weight", 1))))
        rules.append((backends, rule.get("matches") or [{}], rule_timeouts(rule)))
    resolved = failures[0] if failures else condition("ResolvedRefs", True, "ResolvedRefs", "all backendRefs resolve")
    return rules, resolved, pools


def _path(match: dict) -> tuple[str, str]:
    path = match.get("path") or {}
    return path.get("type", "PathPrefix"), path.get("value", "/")


def _order_key(route: dict) -> tuple:
    # Gateway API tie-break: the oldest route wins, then alphabetical namespace/name.
    meta = route.get("metadata") or {}
    return meta.get("creationTimestamp", ""), naming.namespace_of(route), naming.name_of(route)


def _unsupported_match(match: dict) -> bool:
    return _path(match)[0] not in ("PathPrefix", "Exact")


def routes_for_gateway(gateway: dict, httproutes: list[dict], pools: list[dict], services: list[dict],
                       referencegrants: list[dict], pool_endpoints: dict[tuple[str, str], list[str]] | None = None,
                       namespaces: dict[str, dict] | None = None,
                       fallback_pools: frozenset[tuple[str, str]] = frozenset(),
                       response_needs: Mapping[tuple[str, str], str] | None = None) -> GatewayRouting:
    """Attach `httproutes` to `gateway`'s listeners and resolve their backends.

    `pool_endpoints` maps (ns, pool) to its ready pods' ip:port (FailOpen's cluster, and the hosts of an
    override_host cluster); `fallback_pools` are the pools whose EPP answers with lists (pool.returns_lists);
    `response_needs` what of a response each pool's EPP reads (pool.response_needs; absent: the body);
    `namespaces` maps a namespace to its labels (for listeners admitting routes by namespace selector)."""
    look = Lookups({naming.key_of(p): p for p in pools}, {naming.key_of(s): s for s in services},
                   referencegrants, pool_endpoints or {}, frozenset(fallback_pools), dict(response_needs or {}))
    rules, parents, used, attached = [], {}, set(), {l.get("name"): 0 for l in _http_listeners(gateway)}
    for order, route in enumerate(sorted(httproutes, key=_order_key)):
        gen = (route.get("metadata") or {}).get("generation")
        for parent_ref in (route.get("spec") or {}).get("parentRefs") or []:
            if not _refers_to(parent_ref, route, gateway):
                continue
            listeners, rejected = _match_listeners(parent_ref, route, gateway, namespaces or {})
            route_rules, resolved, route_pools = _route_rules(route, look)
            if rejected:
                conds = [{**rejected, "observedGeneration": gen} if gen is not None else rejected, resolved]
            elif any(_unsupported_match(m) for _, ms, _ in route_rules for m in ms):
                conds = [condition("Accepted", False, "UnsupportedValue",
                                   "only PathPrefix and Exact path matches are supported", gen), resolved]
            else:
                conds = [condition("Accepted", True, "Accepted", "attached to the Gateway", gen), resolved]
                used |= route_pools
                rules += _rules_for(route, route_rules, listeners, order)
                for listener, _ in listeners:
                    attached[listener.get("name")] += 1
            entry = {"parentRef": parent_ref, "controllerName": naming.CONTROLLER_NAME, "conditions": conds}
            parents.setdefault(naming.key_of(route), []).append(entry)
    return GatewayRouting(rules, parents, sorted(used), attached)


def _rules_for(route: dict, route_rules: list, listeners: list[tuple[dict, list[str]]], order: int) -> list[RouteRule]:
    out = []
    ns, name = naming.key_of(route)
    for listener, hostnames in listeners:
        for i, (backends, matches, timeouts) in enumerate(route_rules):
            for j, match in enumerate(matches):
                path_type, path_value = _path(match)
                out.append(RouteRule(name=f"{ns}/{name}/{i}/{j}", listen_port=container_port(listener["port"]),
                                     backends=backends, hostnames=hostnames, path_type=path_type,
                                     path_value=path_value, order=order, timeouts=timeouts))
    return out


def render_config(gateway: dict, routing: GatewayRouting, tracing: EnvoyTracing | None = None,
                  xds: XdsAddress | None = None) -> dict[str, dict]:
    """The Gateway's Envoy config files, {file name: document}: the bootstrap, route tables and clusters;
    `tracing`: Envoy's OpenTelemetry tracer (the operator's --otlp-traces-endpoint); `xds`: the operator's xDS
    server, for the xDS form (operator/xds/xds_files.py: a minimal bootstrap, everything else served over ADS)."""
    ports = [container_port(l["port"]) for l in _http_listeners(gateway)]
    files = render_gateway_files(routing.rules, ports or [container_port(80)], ADMIN_PORT,
                                 node_id=xds_node_id(gateway), node_cluster=naming.envoy_name(gateway),
                                 tracing=tracing)
    return xds_files(files, xds) if xds is not None else files


def xds_node_id(gateway: dict) -> str:
    """The node id of a Gateway's Envoys: which snapshot the xDS server gives them."""
    return f"{naming.namespace_of(gateway)}/{naming.name_of(gateway)}"


def httproute_status(route: dict, our_parents: list[dict], now: str | None = None) -> dict:
    """HTTPRoute.status: other controllers' parents kept, ours replaced by `our_parents` (all our Gateways')."""
    previous = (route.get("status") or {}).get("parents") or []
    others = [p for p in previous if p.get("controllerName") != naming.CONTROLLER_NAME]
    ours = []
    for entry in our_parents:
        old = next((p for p in previous if p.get("parentRef") == entry["parentRef"]
                    and p.get("controllerName") == naming.CONTROLLER_NAME), {})
        ours.append({**entry, "conditions": stamp(entry["conditions"], old.get("conditions"), now)})
    return {"parents": others + ours}


# --- the Envoy objects ---------------------------------------------------------------------------------------

def _config_text(rendered: dict) -> str:
    return json.dumps(rendered, sort_keys=True, indent=1)  # JSON is YAML; sorted keys keep it byte-stable


CONFIG_DIR = "/etc/envoy"  # the ConfigMap's mount, and Envoy's working directory


def _envoy_ports(gateway: dict) -> list[int]:
    return sorted({l["port"] for l in _http_listeners(gateway)})


def _envoy_container(gateway: dict, image: str, xds: bool = False, bind_pod_ip: bool = False) -> dict:
    ports = _envoy_ports(gateway)
    container = {
        "name": "envoy",
        "image": image,
        # Routes and clusters are files Envoy watches in its working directory (the mounted ConfigMap), so
        # their changes apply in place; a bootstrap change (listener ports) rolls the pods. No hot restart: it
        # needs shared memory.
        "command": ["envoy", "-c", f"{CONFIG_DIR}/{BOOTSTRAP_FILE}", "--disable-hot-restart", "--log-level", "info"],
        "workingDir": CONFIG_DIR,
        "ports": [{"name": f"http-{p}", "containerPort": container_port(p), "protocol": "TCP"} for p in ports],
        "readinessProbe": {"tcpSocket": {"port": container_port(ports[0]) if ports else ADMIN_PORT},
                           "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": container_port(ports[0]) if ports else ADMIN_PORT},
                          "periodSeconds": 10, "failureThreshold": 3},
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                         {"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}},
    }
    if xds:
        # Everything but the bootstrap comes over ADS. The pod's name in the node metadata says which Envoy
        # ACKed what (operator/xds/ack_report.py). No liveness probe on a listener: listeners exist only once
        # the operator answered, and an Envoy waiting for an unreachable operator is not broken.
        metadata = {"pod": "$(POD_NAME)", **({"listen_host": "$(POD_IP)"} if bind_pod_ip else {})}
        container["command"] += ["--config-yaml", json.dumps({"node": {"metadata": metadata}})]
        container["env"] = [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
        if bind_pod_ip:  # pods sharing one network namespace (the e2e rig): listeners on the pod's own IP
            container["env"].append({"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
        del container["livenessProbe"]
    return container


def envoy_bootstrap_digest(files: dict[str, str]) -> str:
    """The Envoy pods' config annotation: the digest of the bootstrap among the rendered `files`, only. Route
    tables and clusters reach a running Envoy through the mounted ConfigMap; a bootstrap change (listener ports)
    needs new pods."""
    return hashlib.sha256(files[BOOTSTRAP_FILE].encode()).hexdigest()[:16]


# Envoy resets every stream of a cluster it removes: an ext_proc stream to a deleted pool's EPP, a response still
# coming from one of its endpoints. So a cluster whose routes are gone stays in cds.yaml this long (the routes
# leave at once), and the ConfigMap's annotation remembers until when; a reconcile after that drops it.
CLUSTER_LINGER_S = 30.0
RETIRED_ANNOTATION = "kvgate.dev/retired-clusters"


def _bounded_loads(text: str):
    """A value the operator wrote into its ConfigMap, read back within bounded_json's limits (anyone who may edit
    the ConfigMap could have rewritten it): a ValueError, never a RecursionError, when it is not what we wrote."""
    return bounded_json.loads(text, bounded_json.CONFIG_BYTES)


def retain_retired_clusters(rendered_config: dict[str, dict], previous_config_map: dict | None,
                            now: float) -> tuple[dict[str, dict], dict[str, float]]:
    """`rendered_config` with the clusters the previous ConfigMap had and the new config dropped kept until
    their deadline (CLUSTER_LINGER_S after they first went); and {cluster: deadline} of those kept."""
    if not previous_config_map or CDS_FILE not in rendered_config:
        return rendered_config, {}
    try:
        previous = _bounded_loads((previous_config_map.get("data") or {}).get(CDS_FILE) or "{}").get("resources") \
            or []
        deadlines = _bounded_loads(((previous_config_map.get("metadata") or {}).get("annotations") or {})
                                   .get(RETIRED_ANNOTATION) or "{}")
    except (ValueError, AttributeError):
        return rendered_config, {}  # not ours to read: start afresh
    clusters = list(rendered_config[CDS_FILE].get("resources") or [])
    wanted = {c.get("name") for c in clusters}
    retired, kept_files = {}, {}
    for cluster in previous:
        name = cluster.get("name")
        if name in wanted:
            continue
        deadline = float(deadlines.get(name, now + CLUSTER_LINGER_S))
        if deadline > now:
            retired[name] = deadline
            clusters.append(cluster)
            eds = _eds_file_of(cluster)  # an EPP cluster fed by its own file keeps the file too
            if eds and eds not in rendered_config:
                try:
                    kept_files[eds] = _bounded_loads((previous_config_map.get("data") or {})[eds])
                except (KeyError, ValueError):
                    pass
    if not retired:
        return rendered_config, {}
    return {**rendered_config, **kept_files, CDS_FILE: {**rendered_config[CDS_FILE], "resources": clusters}}, retired


def _eds_file_of(cluster: dict) -> str | None:
    eds_config = (cluster.get("eds_cluster_config") or {}).get("eds_config") or {}
    if eds_config == ADS_SOURCE:  # the xDS form: the endpoints' file is named after the cluster
        return eds_file(cluster.get("name", ""))
    path = (eds_config.get("path_config_source") or {}).get("path")
    return file_name(path) if isinstance(path, str) else None


def desired_envoy_objects(gateway: dict, rendered_config: dict[str, dict], image: str,
                          service_type: str = "ClusterIP", previous_config_map: dict | None = None,
                          now: float | None = None, bind_pod_ip: bool = False) -> list[dict]:
    """ConfigMap (Envoy's config files, render_config's, plus clusters lingering after their routes: see
    retain_retired_clusters), Deployment (Envoy) and Service (the listener ports) of a Gateway."""
    name = naming.envoy_name(gateway)
    labels = naming.component_labels("gateway", naming.name_of(gateway))
    selector = naming.selector_labels("gateway", naming.name_of(gateway))
    rendered_config, retired = retain_retired_clusters(rendered_config, previous_config_map,
                                                       time.time() if now is None else now)
    files = {file: _config_text(doc) for file, doc in sorted(rendered_config.items())}
    digest = envoy_bootstrap_digest(files)
    xds = is_xds_file_set(rendered_config)
    # The xDS form mounts only the bootstrap: the other keys are served over ADS, not read by Envoy.
    volume = {"name": name, **({"items": [{"key": BOOTSTRAP_FILE, "path": BOOTSTRAP_FILE}]} if xds else {})}
    annotations = {RETIRED_ANNOTATION: json.dumps(retired, sort_keys=True)} if retired else None
    config_map = {"apiVersion": "v1", "kind": "ConfigMap",
                  "metadata": naming.object_meta(name, gateway, labels, annotations), "data": files}
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": naming.object_meta(name, gateway, labels),
        "spec": {"replicas": 1, "selector": {"matchLabels": selector}, "template": {
            "metadata": {"labels": labels, "annotations": {"kvgate.dev/config-digest": digest}},
            "spec": {"containers": [_envoy_container(gateway, image, xds, bind_pod_ip)],
                     "volumes": [{"name": "config", "configMap": volume}, {"name": "tmp", "emptyDir": {}}],
                     "automountServiceAccountToken": False,
                     "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
                                         "seccompProfile": {"type": "RuntimeDefault"}}}}},
    }
    service = {"apiVersion": "v1", "kind": "Service", "metadata": naming.object_meta(name, gateway, labels),
               "spec": {"type": service_type, "selector": selector, "ports": [
                   {"name": f"http-{p}", "port": p, "targetPort": container_port(p), "protocol": "TCP"}
                   for p in _envoy_ports(gateway)]}}
    return [config_map, deployment, service]


# --- Gateway status ------------------------------------------------------------------------------------------

def gateway_addresses(service: dict | None) -> list[dict]:
    """Load-balancer addresses when the Service has them, else its cluster IP."""
    status = ((service or {}).get("status") or {}).get("loadBalancer") or {}
    out = []
    for ingress in status.get("ingress") or []:
        if ingress.get("ip"):
            out.append({"type": "IPAddress", "value": ingress["ip"]})
        elif ingress.get("hostname"):
            out.append({"type": "Hostname", "value": ingress["hostname"]})
    cluster_ip = ((service or {}).get("spec") or {}).get("clusterIP")
    if not out and cluster_ip and cluster_ip != "None":
        out.append({"type": "IPAddress", "value": cluster_ip})
    return out


def _listener_status(listener: dict, programmed: bool, gen: int | None) -> list[dict]:
    if listener.get("protocol") != "HTTP":
        return [condition("Accepted", False, "UnsupportedProtocol", f"protocol {listener.get('protocol')} is not "
                          "supported (HTTP only)", gen),
                condition("Programmed", False, "Invalid", "listener not accepted", gen),
                condition("ResolvedRefs", True, "ResolvedRefs", "", gen)]
    return [condition("Accepted", True, "Accepted", "", gen),
            condition("Programmed", programmed, "Programmed" if programmed else "Pending", "", gen),
            condition("ResolvedRefs", True, "ResolvedRefs", "", gen)]


def gateway_status(gateway: dict, deployment: dict | None, service: dict | None, routing: GatewayRouting,
                   now: str | None = None, xds: tuple[bool, str, str] | None = None) -> dict:
    """Gateway.status: Accepted, Programmed (Envoy ready and an address known; with `xds`, the (programmed,
    reason, message) of the Envoys' answers to the current config: ack_report.xds_programmed), addresses,
    listeners."""
    gen = (gateway.get("metadata") or {}).get("generation")
    previous = gateway.get("status") or {}
    addresses = gateway_addresses(service)
    ready = int(((deployment or {}).get("status") or {}).get("readyReplicas") or 0) > 0
    programmed = ready and bool(addresses)
    has_http = bool(_http_listeners(gateway))
    accepted = (condition("Accepted", True, "Accepted", "", gen) if has_http
                else condition("Accepted", False, "ListenersNotValid", "no HTTP listener", gen))
    why = "Envoy is ready" if programmed else ("waiting for an address" if ready else "waiting for Envoy to be ready")
    reason = "Programmed" if programmed else "Pending"
    if xds is not None and (programmed or xds[1] == "Invalid"):  # a NACK shows even while no Envoy is ready
        programmed, reason, why = xds
    conds = [accepted, condition("Programmed", programmed, reason, why, gen)]
    old_listeners = {l.get("name"): l for l in previous.get("listeners") or []}
    listeners = [{"name": l.get("name"), "supportedKinds": [dict(HTTPROUTE_KIND)],
                  "attachedRoutes": routing.attached_routes.get(l.get("name"), 0),
                  "conditions": stamp(_listener_status(l, programmed, gen),
                                      (old_listeners.get(l.get("name")) or {}).get("conditions"), now)}
                 for l in (gateway.get("spec") or {}).get("listeners") or []]
    return {"addresses": addresses, "conditions": stamp(conds, previous.get("conditions"), now),
            "listeners": listeners}
