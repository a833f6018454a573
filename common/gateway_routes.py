"""kvgate's one route model: Gateway API rules (listeners, route precedence, weighted backendRefs) rendered as
Envoy configs — the operator's Gateways (a file set Envoy reloads) and `kvgate up`, the tests and the benchmarks
(`render_static_gateway`, `render_pool_gateway`: the same rules folded into one static bootstrap).

Beyond one pool on one listener, a Gateway needs:

- Weighted backendRefs across pools. Envoy's `weighted_clusters` cannot do it: the pool's ext_proc filter is
  switched on per *route*, and the EPP's `clear_route_cache` makes Envoy match the route again, so the split
  must be decided by the route match itself and come out the same both times. `runtime_fraction` does
  exactly that: Envoy compares it with the stream's random id (fixed for the whole request), so the
  re-match after the EPP answers lands on the same pool's "picked" route. Backend i of a rule matches when
  `id mod 10^6 < cumulative weight up to i` (scaled to 10^6); earlier backends have taken the lower range
  and the last backend takes the rest.
- Service backendRefs (a STRICT_DNS cluster of the Service's name), and backendRefs that did not resolve,
  which answer 500 for their share of the traffic as the Gateway API requires.
- One virtual host per hostname, holding every rule whose hostnames cover it, so a request for
  a.example.com still reaches the rules of routes without hostnames; rules ordered by Gateway API
  precedence (Exact path first, then longer prefixes).

Route and pool changes reach a running Envoy without a restart. A Gateway's config is a set of files, all in
one ConfigMap (`render_gateway_files`): mounted at /etc/envoy in the operator's `files` mode, as described
here; served over ADS in its `xds` mode (kvgate.operator.xds.xds_files turns the set into its xDS form):

- `envoy.yaml`, the bootstrap: admin, node, and one listener per port whose connection manager takes its
  route table from RDS, and `dynamic_resources.cds_config` for the clusters. Only this file changes the
  pods (its digest is their annotation), and only a listener port change (or a new renderer) changes it.
- `rds-<port>.yaml`, each listener's RouteConfiguration, `cds.yaml`, every cluster, and (EPPs reached by pod
  IP) `eds-<cluster>.yaml`, an EPP cluster's pods (see envoy_config.pool_clusters for why EDS): file subscriptions
  with `watched_directory` on the mount, so Envoy reloads them when the kubelet swaps the volume's `..data`
  symlink. An RDS update swaps the route table in place (connections are not drained); a CDS update warms
  new or changed clusters before they take traffic and leaves unchanged ones alone.

Listeners stay in the bootstrap rather than LDS: a listener update drains its connections, and its HTTP
filters need not change with the pools, since one ext_proc filter serves them all (each pool's routes switch
it on, naming the pool's EPP cluster and failure mode: `shared_ext_proc_route_config`).

RDS does not validate cluster names, so neither file's update can be rejected because of the other. On one
volume swap Envoy (1.40) reloads the route tables first, then the clusters: a route leaves a cluster
before the cluster goes, but a route to a cluster new in the same update answers 503 (a pool's ext_proc call
fails: 500 under FailClose) until CDS has added and warmed it — about a millisecond, or until the first
health check of a new EPP cluster. Closing that gap needs two ConfigMap writes (the clusters, then the routes).

The paths in the bootstrap are relative to Envoy's working directory, which the Deployment sets to the mount:
the config then works wherever the files are (a test's temporary folder, a pod runner's volume folder).

Every Envoy structure — listener, filters, a pool's route and clusters, a Service's cluster — comes from
`kvgate.common.envoy_config` (the one data-plane module, shared with `kvgate up`); this module only arranges them into
Gateway API semantics and files. `static_bootstrap` folds a file set into one static bootstrap (what
`envoy --mode validate` can check whole).

Timeouts per rule come from the HTTPRoute rule's `timeouts` (Gateway API: `request` bounds the whole request,
`backendRequest` each try to a backend; "0s" disables one, as the Gateway API says), else the defaults of
`kvgate.common.envoy_config.RouteTimeouts` (600 s per request, no per-try limit).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from kvgate.common.envoy_config import (EnvoyTracing, ListenerTimeouts, PoolBackend, RouteTimeouts, add_tracing,
                                 cluster_route, dns_cluster,
                                 epp_load_assignment, listener, overload_manager, pool_clusters, pool_routes)

FRACTION_DENOMINATOR = 1_000_000


@dataclass(frozen=True)
class ServiceBackend:
    name: str  # unique per config, e.g. "<namespace>-<service>-<port>"
    host: str
    port: int


@dataclass
class WeightedBackend:
    backend: PoolBackend | ServiceBackend | None  # None: a backendRef that did not resolve (answers 500)
    weight: int = 1


@dataclass
class RouteRule:
    name: str  # "<namespace>/<route>/<rule index>": for logs and route names
    listen_port: int
    backends: list[WeightedBackend]
    hostnames: list[str] = field(default_factory=lambda: ["*"])
    path_type: str = "PathPrefix"  # PathPrefix or Exact
    path_value: str = "/"
    order: int = 0  # tie-breaker after path precedence (the caller's route order)
    timeouts: RouteTimeouts = field(default_factory=RouteTimeouts)


def _path_match(rule: RouteRule) -> dict:
    if rule.path_type == "Exact":
        return {"path": rule.path_value}
    prefix = rule.path_value.rstrip("/")
    # Gateway API prefixes match whole path elements: /foo matches /foo and /foo/bar, not /foobar.
    return {"path_separated_prefix": prefix} if prefix else {"prefix": "/"}


def _fraction(numerator: int, rule: RouteRule, index: int) -> dict:
    return {"default_value": {"numerator": numerator, "denominator": "MILLION"},
            "runtime_key": f"kvgate.weights.{rule.name.replace('/', '.')}.{index}"}


def _backend_routes(backend: PoolBackend | ServiceBackend | None, match: dict, name: str,
                    timeouts: RouteTimeouts) -> list[dict]:
    if backend is None:
        return [{"name": f"{name}-unresolved", "match": match,
                 "direct_response": {"status": 500, "body": {"inline_string": "backend not resolved\n"}}}]
    if isinstance(backend, ServiceBackend):
        return [cluster_route(f"{name}-service", match, f"svc-{backend.name}", timeouts)]
    return pool_routes(f"{name}-pool", match, backend, timeouts)


def rule_routes(rule: RouteRule) -> list[dict]:
    """The Envoy routes of one Gateway API rule, its weighted split included."""
    live = [b for b in rule.backends if b.weight > 0]
    if not live:  # no backendRefs, or all weights 0: the Gateway API answers 500
        return _backend_routes(None, _path_match(rule), rule.name, rule.timeouts)
    total = sum(b.weight for b in live)
    routes, cumulative = [], 0
    for i, weighted in enumerate(live):
        cumulative += weighted.weight
        match = _path_match(rule)
        if i < len(live) - 1:
            match["runtime_fraction"] = _fraction(round(cumulative * FRACTION_DENOMINATOR / total), rule, i)
        routes += _backend_routes(weighted.backend, match, f"{rule.name}/{i}", rule.timeouts)
    return routes


def hostname_covers(pattern: str, hostname: str) -> bool:
    """Whether requests for `hostname` (itself possibly a wildcard) are within `pattern`."""
    if pattern == "*" or pattern == hostname:
        return True
    return pattern.startswith("*.") and hostname.endswith(pattern[1:]) and hostname != pattern[2:]


def _precedence(rule: RouteRule) -> tuple:
    return (0 if rule.path_type == "Exact" else 1, -len(rule.path_value), rule.order, rule.name)


def virtual_hosts(rules: list[RouteRule]) -> list[dict]:
    domains = sorted({h for r in rules for h in r.hostnames}, key=lambda d: (d == "*", d.startswith("*"), d))
    hosts = []
    for domain in domains:
        members = sorted((r for r in rules if any(hostname_covers(h, domain) for h in r.hostnames)),
                         key=_precedence)
        hosts.append({"name": f"vh-{domain}", "domains": [domain],
                      "routes": [route for r in members for route in rule_routes(r)]})
    return hosts


def _backends(rules: list[RouteRule], kind: type) -> list:
    seen: dict[str, object] = {}
    for rule in rules:
        for weighted in rule.backends:
            if isinstance(weighted.backend, kind):
                seen.setdefault(weighted.backend.name, weighted.backend)
    return [seen[name] for name in sorted(seen)]


BOOTSTRAP_FILE = "envoy.yaml"
CDS_FILE = "cds.yaml"
_CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
_ROUTE_CONFIG_TYPE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
_LOAD_ASSIGNMENT_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"


def rds_file(port: int) -> str:
    return f"rds-{port}.yaml"


def eds_file(cluster: str) -> str:
    return f"eds-{cluster}.yaml"


# Where the kubelet's atomic writer keeps a ConfigMap volume's current files: it swaps this symlink first and
# only then links a *new* key's name at the top of the volume. Envoy rejects a new cluster whose EDS path does not
# exist yet ("paths must refer to an existing path") and does not look again until cds.yaml changes, so an EDS file
# added with its cluster is named through here (without it, tests/e2e/test_envoy_propagation_e2e.py's second pool
# is never routed). Files that exist from the start (cds.yaml, the route tables) keep their plain names.
KUBELET_DATA_DIR = "..data"


def _file_source(name: str, *, through_data_dir: bool = False) -> dict:
    # Relative paths: Envoy's working directory is the config folder. `watched_directory` makes Envoy re-read
    # the file when anything is moved into the folder, which is how the kubelet publishes a ConfigMap update.
    path = f"./{KUBELET_DATA_DIR}/{name}" if through_data_dir else f"./{name}"
    return {"resource_api_version": "V3",
            "path_config_source": {"path": path, "watched_directory": {"path": "."}}}


def file_name(path: str) -> str:
    """The key in the file set of a path a config source names."""
    return path.removeprefix("./").removeprefix(f"{KUBELET_DATA_DIR}/")


def _listener(port: int, listen_host: str, timeouts: ListenerTimeouts) -> dict:
    rds = {"rds": {"route_config_name": f"gateway-{port}", "config_source": _file_source(rds_file(port))}}
    return listener(f"gateway-{port}", listen_host, port, rds, timeouts)


def render_gateway_files(rules: list[RouteRule], listen_ports: list[int], admin_port: int | None = None,
                         listen_host: str = "0.0.0.0", node_id: str = "kvgate-gateway",
                         node_cluster: str = "kvgate-gateway", admin_host: str = "127.0.0.1",
                         listener_timeouts: ListenerTimeouts = ListenerTimeouts(),
                         tracing: EnvoyTracing | None = None) -> dict[str, dict]:
    """A Gateway's Envoy config as files {name: document}: the bootstrap, one route table per listener port
    (RDS) and the clusters (CDS). Load it with the folder holding all of them as Envoy's working directory.
    `tracing`: Envoy's OpenTelemetry tracer on every listener (its collector cluster is static, in the bootstrap)."""
    ports = sorted(set(listen_ports))
    bootstrap = {
        "node": {"id": node_id, "cluster": node_cluster},
        "dynamic_resources": {"cds_config": _file_source(CDS_FILE)},
        "static_resources": {"listeners": [_listener(port, listen_host, listener_timeouts) for port in ports]},
        "overload_manager": overload_manager(),
    }
    if admin_port is not None:
        bootstrap["admin"] = {"address": {"socket_address": {"address": admin_host, "port_value": admin_port}}}
    add_tracing(bootstrap, tracing)
    files = {BOOTSTRAP_FILE: bootstrap}
    for port in ports:
        route_config = {"@type": _ROUTE_CONFIG_TYPE, "name": f"gateway-{port}",
                        "virtual_hosts": virtual_hosts([r for r in rules if r.listen_port == port])}
        files[rds_file(port)] = {"resources": [route_config]}
    clusters = []
    for pool in _backends(rules, PoolBackend):
        if pool.epp_pods is None:
            clusters += pool_clusters(pool)
            continue
        # The EPP's pods by IP: their own file (EDS), so a new EPP pod changes hosts, not the cluster.
        load_assignment = epp_load_assignment(pool)
        files[eds_file(load_assignment["cluster_name"])] = {
            "resources": [{"@type": _LOAD_ASSIGNMENT_TYPE, **load_assignment}]}
        clusters += pool_clusters(pool, _file_source(eds_file(load_assignment["cluster_name"]), through_data_dir=True))
    clusters += [dns_cluster(f"svc-{s.name}", s.host, s.port) for s in _backends(rules, ServiceBackend)]
    files[CDS_FILE] = {"resources": [{"@type": _CLUSTER_TYPE, **c} for c in clusters]}
    return files


def _untyped(resource: dict) -> dict:
    return {k: v for k, v in resource.items() if k != "@type"}


def static_bootstrap(files: dict[str, dict]) -> dict:
    """The same config as one static bootstrap: each listener's route table inline, the clusters static.

    `envoy --mode validate` does not read dynamic resources, so this is what checks the RDS and CDS files;
    inline route tables also check that every cluster a route names exists (`validate_clusters`)."""
    bootstrap = copy.deepcopy(files[BOOTSTRAP_FILE])
    bootstrap.pop("dynamic_resources", None)
    for listener_doc in bootstrap["static_resources"]["listeners"]:  # (`listener` is envoy_config's builder)
        hcm = listener_doc["filter_chains"][0]["filters"][0]["typed_config"]
        rds = hcm.pop("rds")
        (route_config,) = files[file_name(rds["config_source"]["path_config_source"]["path"])]["resources"]
        hcm["route_config"] = {**_untyped(route_config), "validate_clusters": True}
    bootstrap["static_resources"]["clusters"] = [*bootstrap["static_resources"].get("clusters", []),
                                                 *(_static_cluster(_untyped(c), files)
                                                   for c in files[CDS_FILE]["resources"])]
    return bootstrap


def _static_cluster(cluster: dict, files: dict[str, dict]) -> dict:
    """An EDS cluster with its file's hosts inline (STATIC); other clusters as they are."""
    if cluster.get("type") != "EDS":
        return cluster
    eds = cluster.pop("eds_cluster_config")
    (assignment,) = files[file_name(eds["eds_config"]["path_config_source"]["path"])]["resources"]
    return {**cluster, "type": "STATIC", "load_assignment": _untyped(assignment)}


def listeners_of(files: dict[str, dict]) -> list[dict]:
    """The listeners of a file set, each with its route table inline (for tests and tools reading a config)."""
    return static_bootstrap(files)["static_resources"]["listeners"]


# --- one static bootstrap: `kvgate up`, the tests, the benchmarks ----------------------------------------------------

def render_static_gateway(rules: list[RouteRule], listen_host: str, admin_port: int | None = None, *,
                          admin_host: str = "127.0.0.1",
                          listener_timeouts: ListenerTimeouts = ListenerTimeouts(),
                          tracing: EnvoyTracing | None = None) -> dict:
    """The rules' config as one static bootstrap (a listener per port of the rules): what `envoy -c` loads."""
    return static_bootstrap(render_gateway_files(rules, [r.listen_port for r in rules], admin_port, listen_host,
                                                 admin_host=admin_host, listener_timeouts=listener_timeouts,
                                                 tracing=tracing))


def render_pool_gateway(pool: PoolBackend, listen_host: str, listen_port: int, admin_port: int | None = None, *,
                        route_timeouts: RouteTimeouts = RouteTimeouts(),
                        listener_timeouts: ListenerTimeouts = ListenerTimeouts(),
                        tracing: EnvoyTracing | None = None) -> dict:
    """One pool behind one listener, every path of every host: `kvgate up`'s gateway (an HTTPRoute with one rule
    and one backendRef in Gateway API terms)."""
    rule = RouteRule(f"local/{pool.name}/0", listen_port, [WeightedBackend(pool)], timeouts=route_timeouts)
    return render_static_gateway([rule], listen_host, admin_port, listener_timeouts=listener_timeouts,
                                 tracing=tracing)
