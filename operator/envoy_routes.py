"""Envoy bootstraps for Gateways: several listeners, Gateway API route precedence, weighted backendRefs.

`kvgate.envoy_config.render_gateway` renders one pool per route on one listener. A Gateway needs more:

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

The filters and the per-pool clusters come from `render_gateway` itself, so both renderers stay in step.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from kvgate.envoy_config import DESTINATION_HEADER, PoolBackend, Route, render_gateway, report_upstream_host

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


def _path_match(rule: RouteRule) -> dict:
    if rule.path_type == "Exact":
        return {"path": rule.path_value}
    prefix = rule.path_value.rstrip("/")
    # Gateway API prefixes match whole path elements: /foo matches /foo and /foo/bar, not /foobar.
    return {"path_separated_prefix": prefix} if prefix else {"prefix": "/"}


def _fraction(numerator: int, rule: RouteRule, index: int) -> dict:
    return {"default_value": {"numerator": numerator, "denominator": "MILLION"},
            "runtime_key": f"kvgate.weights.{rule.name.replace('/', '.')}.{index}"}


def _enable_ext_proc(pool: PoolBackend) -> dict:
    return {f"envoy.filters.http.ext_proc.{pool.name}": {
        "@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig",
        "config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
                   "overrides": {}}}}


_NO_TIMEOUT = {"timeout": "0s", "idle_timeout": "0s"}  # streamed generations may run for minutes


def _backend_routes(backend: PoolBackend | ServiceBackend | None, match: dict, name: str) -> list[dict]:
    if backend is None:
        return [{"name": f"{name}-unresolved", "match": match,
                 "direct_response": {"status": 500, "body": {"inline_string": "backend not resolved\n"}}}]
    if isinstance(backend, ServiceBackend):
        return [{"name": f"{name}-service", "match": match,
                 "route": {"cluster": f"svc-{backend.name}", **_NO_TIMEOUT}}]
    picked = {**match, "headers": [{"name": DESTINATION_HEADER, "present_match": True}]}
    enable = _enable_ext_proc(backend)
    return [{"name": f"{name}-picked", "match": picked, "route": {"cluster": f"pool-{backend.name}", **_NO_TIMEOUT},
             "response_headers_to_add": report_upstream_host(), "typed_per_filter_config": enable},
            {"name": f"{name}-fallback", "match": match,
             "route": {"cluster": f"pool-{backend.name}-fallback", **_NO_TIMEOUT},
             "response_headers_to_add": report_upstream_host(), "typed_per_filter_config": enable}]


def rule_routes(rule: RouteRule) -> list[dict]:
    """The Envoy routes of one Gateway API rule, its weighted split included."""
    live = [b for b in rule.backends if b.weight > 0]
    if not live:  # no backendRefs, or all weights 0: the Gateway API answers 500
        return _backend_routes(None, _path_match(rule), rule.name)
    total = sum(b.weight for b in live)
    routes, cumulative = [], 0
    for i, weighted in enumerate(live):
        cumulative += weighted.weight
        match = _path_match(rule)
        if i < len(live) - 1:
            match["runtime_fraction"] = _fraction(round(cumulative * FRACTION_DENOMINATOR / total), rule, i)
        routes += _backend_routes(weighted.backend, match, f"{rule.name}/{i}")
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


def _service_cluster(backend: ServiceBackend) -> dict:
    return {"name": f"svc-{backend.name}", "type": "STRICT_DNS", "lb_policy": "LEAST_REQUEST",
            "connect_timeout": "2s",
            "load_assignment": {"cluster_name": f"svc-{backend.name}", "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {"address": backend.host,
                                                             "port_value": backend.port}}}}]}]}}


def _backends(rules: list[RouteRule], kind: type) -> list:
    seen: dict[str, object] = {}
    for rule in rules:
        for weighted in rule.backends:
            if isinstance(weighted.backend, kind):
                seen.setdefault(weighted.backend.name, weighted.backend)
    return [seen[name] for name in sorted(seen)]


def render_gateway_bootstrap(rules: list[RouteRule], listen_ports: list[int], admin_port: int | None = None,
                             listen_host: str = "0.0.0.0") -> dict:
    """A complete Envoy bootstrap: one listener per port, serving the rules of that port."""
    pools = _backends(rules, PoolBackend)
    ports = sorted(set(listen_ports))
    base = render_gateway([Route(pool=p) for p in pools], listen_host, ports[0] if ports else 8080, admin_port)
    template = base["static_resources"]["listeners"][0]
    listeners = []
    for port in ports:
        listener = copy.deepcopy(template)
        listener["name"] = f"gateway-{port}"
        listener["address"]["socket_address"]["port_value"] = port
        hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
        hcm["stat_prefix"] = f"gateway_{port}"
        hcm["strip_any_host_port"] = True  # Host "a.example.com:8080" matches hostname a.example.com
        hosts = virtual_hosts([r for r in rules if r.listen_port == port])
        hcm["route_config"] = {"name": f"gateway-{port}", "virtual_hosts": hosts}
        listeners.append(listener)
    base["static_resources"]["listeners"] = listeners
    base["static_resources"]["clusters"] += [_service_cluster(s) for s in _backends(rules, ServiceBackend)]
    return base
