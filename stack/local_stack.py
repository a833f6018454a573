"""A whole kvgate stack on one machine, on loopback: N engines, the EPP (one or several replicas) and Envoy,
started in a supervisor.Stack as a StackSpec describes — by `kvgate up`, the benchmarks and the chaos runs."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvgate.common.envoy_config import (CircuitBreakers, EnvoyTracing, ListenerTimeouts, PoolBackend, RouteTimeouts,
                                       envoy_binary, tracing_from_env)
from kvgate.common.gateway_routes import render_pool_gateway
from kvgate.common.processes import port_taken
from kvgate.stack.supervisor import Child, Stack

# Active-passive EPPs on one machine (StackSpec.epp_leader_election): lease duration, renew deadline and
# retry period, seconds — short, so a killed leader's follower leads soon (the Lease holds whole seconds).
EPP_LEASE_TIMINGS = (2.0, 1.5, 0.25)


def epp_healthy_in_envoy(admin_port: int, cluster: str, hosts: int = 1) -> bool:
    """Whether Envoy's health check has found the EPP serving (its /clusters lists `hosts` hosts as healthy)."""
    import httpx

    try:
        text = httpx.get(f"http://127.0.0.1:{admin_port}/clusters", timeout=2).text
    except httpx.HTTPError:
        return False
    return sum(line.startswith(f"{cluster}::") and line.endswith("::health_flags::healthy")
               for line in text.splitlines()) >= hosts


@dataclass
class LocalStack:
    """A started stack: its children (by name: engine-0.., epp, envoy) and where each listens."""
    stack: Stack
    url: str
    model: str
    engine_ports: list[int]
    grpc_port: int
    health_port: int
    metrics_port: int
    admin_port: int
    envoy_flavor: str
    engine_hosts: list[str] = field(default_factory=list)  # one per engine; empty: all on 127.0.0.1
    event_sockets: list[tuple[str, str]] = field(default_factory=list)  # each engine's KV-event (PUB, replay)
    # more EPP replicas (epp-1, ...: hosts of Envoy's EPP cluster, active-active or, with leader election,
    # active-passive): their metrics, ext-proc and health ports
    extra_epp_metrics_ports: list[int] = field(default_factory=list)
    extra_epp_grpc_ports: list[int] = field(default_factory=list)
    extra_epp_health_ports: list[int] = field(default_factory=list)

    @property
    def epp_metrics_ports(self) -> list[int]:
        return [self.metrics_port, *self.extra_epp_metrics_ports]

    @property
    def epps(self) -> list[tuple[str, int, int]]:
        """Every EPP child: (its name, ext-proc port, health port)."""
        return [("epp", self.grpc_port, self.health_port),
                *((f"epp-{i + 1}", g, h) for i, (g, h) in enumerate(zip(self.extra_epp_grpc_ports,
                                                                         self.extra_epp_health_ports)))]

    @property
    def endpoints(self) -> list[str]:
        hosts = self.engine_hosts or ["127.0.0.1"] * len(self.engine_ports)
        return [f"{h}:{p}" for h, p in zip(hosts, self.engine_ports)]

    def child(self, name: str) -> Child:
        return next(c for c in self.stack.children if c.name == name)


def epp_tokenizer_args(model: str, kv_events: bool, epp_args=()) -> list[str]:
    """The EPP's --tokenizer for a precise prefix index: the engines' model folder. Without it the EPP tokenizes
    with the sim's byte tokenizer (the demo model's too), so a real model's prompts would hash to blocks no
    engine announces and every request would score as a miss."""
    if not kv_events or model == "demo" or "--tokenizer" in epp_args or not Path(model).is_dir():
        return []
    return ["--tokenizer", str(Path(model).resolve())]


@dataclass(frozen=True)
class StackSpec:
    """What launch_local_stack starts: `replicas` engines (`kvgate serve MODEL --backend BACKEND`), the EPP over them
    and Envoy, whose gateway listens on `host`:`port`."""
    replicas: int
    model: str
    backend: str
    host: str
    port: int
    fail_open: bool = False  # the EPP's failure mode in kvgate's Envoy config: FailOpen instead of FailClose
    # the EPP's config (--config-file / --config-text); one whose picker returns fallbacks gets kvgate's
    # override_host route, whose retries walk them
    epp_config_file: str | None = None
    epp_config_text: str | None = None
    engine_args: Sequence[str] = ()  # flags for every engine
    limits: tuple[RouteTimeouts, ListenerTimeouts, CircuitBreakers] | None = None  # None: envoy_config's defaults
    # kvgate: kvgate's rendered config; upstream: the stock upstream-shaped one; round-robin: Envoy's own
    # round-robin over the engines and no EPP, a benchmark's baseline
    envoy_flavor: str = "kvgate"
    startup_timeout: float = 300.0  # seconds until a request can be routed, else TimeoutError
    # each engine on its own loopback address (127.0.0.x: endpoints that differ by address, as pods do); None: all
    # on 127.0.0.1
    engine_hosts: Sequence[str] | None = None
    engine_args_for: Callable[[int, str], list[str]] | None = None  # (i, host) -> more flags for engine i
    epp_args: Sequence[str] = ()  # more flags for every EPP
    # every engine publishes KV-cache events on a PUB and a replay socket of its own, bound on the IPv6 loopback
    # (vLLM binds an address with `::` or `*`, and connects to any other), and the EPP is told each one
    # (--kv-events-endpoint)
    kv_events: bool = False
    # another PUB address the EPP is told for engine i (`kvgate bench hostile` binds a rogue publisher there)
    epp_kv_event_override: Mapping[int, str] | None = None
    # > 1 (kvgate's Envoy config only): that many EPPs over the same engines, each a host of Envoy's EPP cluster,
    # serving at once (active-active; each sees the engines' metrics and KV events, and, with epp_peer_sync, the
    # others' picks: epp/peer_sync.py, under a pool key made in the stack's workdir, or in clear with
    # epp_peer_sync_insecure; without, only its own in-flight requests)
    epp_replicas: int = 1
    # with epp_replicas > 1: active-passive instead — the EPPs elect a leader over a lease file in the stack's
    # workdir (--ha-lease-file), with epp_lease_timings (lease duration, renew deadline, retry period, seconds);
    # only the leader answers SERVING, so start-up waits for one EPP healthy in Envoy
    epp_leader_election: bool = False
    epp_peer_sync: bool = True
    epp_peer_sync_insecure: bool = False
    epp_lease_timings: tuple[float, float, float] = EPP_LEASE_TIMINGS
    # OpenTelemetry: the OTLP/gRPC collector that Envoy, the EPPs and the engines send their spans to (each
    # component's --otlp-traces-endpoint); None: the OTEL_* variables the stack runs with, else no tracing
    otlp_traces_endpoint: str | None = None

    @property
    def with_epp(self) -> bool:
        return self.envoy_flavor != "round-robin"

    @property
    def leader_election(self) -> bool:
        return self.epp_leader_election and self.epp_replicas > 1

    @property
    def peer_sync(self) -> bool:
        """Active-active replicas share their picks (epp/peer_sync.py)."""
        return self.epp_peer_sync and self.epp_replicas > 1 and not self.leader_election


def launch_local_stack(stack: Stack, spec: StackSpec) -> LocalStack:
    """Start `spec`'s engines, EPPs and Envoy in `stack`, and wait until a request can be routed. ConfigError (the
    EPP's config) and ValueError (a spec that cannot run) come before anything starts; RuntimeError if a child
    dies, TimeoutError past spec.startup_timeout."""
    from kvgate.epp.scheduling.config import load_config

    epp_config = load_config(spec.epp_config_file, spec.epp_config_text)  # ConfigError before anything starts
    if spec.epp_replicas > 1 and spec.envoy_flavor != "kvgate":
        raise ValueError("several EPP replicas need kvgate's Envoy config (an EPP cluster of several hosts)")
    _claim_gateway_port(stack, spec)
    engines = _start_engines(stack, spec)
    epps, admin_port = _reserve_control_ports(stack, spec)
    if spec.with_epp:
        _start_epps(stack, spec, engines, epps)
    _start_envoy(stack, _envoy_config(spec, engines, epps, admin_port, epp_config), admin_port)
    _wait_ready(stack, spec, engines, epps, admin_port)
    (grpc_port, health_port, metrics_port), extra = epps[0], epps[1:]
    return LocalStack(stack, f"http://{spec.host}:{spec.port}", spec.model, engines.ports, grpc_port=grpc_port,
                      health_port=health_port, metrics_port=metrics_port, admin_port=admin_port,
                      envoy_flavor=spec.envoy_flavor, engine_hosts=engines.hosts, event_sockets=engines.event_sockets,
                      extra_epp_metrics_ports=[m for _, _, m in extra], extra_epp_grpc_ports=[g for g, _, _ in extra],
                      extra_epp_health_ports=[h for _, h, _ in extra])


def _kvgate() -> str:
    """The `kvgate` script of this Python environment: every child runs the same kvgate as this process."""
    return str(Path(sys.executable).parent / "kvgate")


def _claim_gateway_port(stack: Stack, spec: StackSpec) -> None:
    """Fail at once if something listens on the gateway's port (else Envoy alone would fail, after the engines had
    started, in its log), and hold it: the engines may take a while, and Envoy binds it last."""
    taken = port_taken(spec.host, spec.port)
    if taken:
        raise RuntimeError(taken)
    stack.reserve_port(spec.host, spec.port)


@dataclass(frozen=True)
class _Engines:
    """The started engines: engine i listens on hosts[i]:ports[i] and, with KV events, publishes on
    event_sockets[i] (PUB, replay)."""
    hosts: list[str]
    ports: list[int]
    event_sockets: list[tuple[str, str]]

    @property
    def endpoints(self) -> list[str]:
        return [f"{h}:{p}" for h, p in zip(self.hosts, self.ports)]


def _start_engines(stack: Stack, spec: StackSpec) -> _Engines:
    """engine-0, engine-1, ...: `kvgate serve`, each on a port of its own and an equal share of the CPUs' threads."""
    if spec.model == "demo" and spec.backend == "torch":  # build once, not in N racing processes
        from kvgate.common.demo import ensure_demo_model

        ensure_demo_model()
    hosts = list(spec.engine_hosts) if spec.engine_hosts else ["127.0.0.1"] * spec.replicas
    ports = [stack.reserve_port(h) for h in hosts]
    event_sockets = [(f"tcp://[::1]:{stack.reserve_port('::1')}", f"tcp://[::1]:{stack.reserve_port('::1')}")
                     for _ in ports] if spec.kv_events else []
    engines = _Engines(hosts, ports, event_sockets)
    threads = str(max(1, (os.cpu_count() or 2) // spec.replicas))
    for i, (host, port) in enumerate(zip(hosts, ports)):
        stack.start(f"engine-{i}", [_kvgate(), "serve", spec.model, "--backend", spec.backend, "--host", host,
                                    "--port", str(port), *spec.engine_args, *_engine_args(spec, engines, i),
                                    *_tracing_args(spec)],
                    env={"OMP_NUM_THREADS": threads})
    return engines


def _engine_args(spec: StackSpec, engines: _Engines, i: int) -> list[str]:
    """Engine i's own flags: spec.engine_args_for's, and its KV-event sockets."""
    extra = spec.engine_args_for(i, engines.hosts[i]) if spec.engine_args_for else []
    if spec.kv_events:
        pub, replay = engines.event_sockets[i]
        extra = [*extra, "--kv-events-config", json.dumps(
            {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub, "replay_endpoint": replay})]
    return extra


def _reserve_control_ports(stack: Stack, spec: StackSpec) -> tuple[list[tuple[int, int, int]], int]:
    """Each EPP's (ext-proc, health, metrics) ports — the first EPP is `epp`, the others epp-1, epp-2, ... — and
    Envoy's admin port."""
    grpc_port, health_port, metrics_port, admin_port = (stack.reserve_port() for _ in range(4))
    extra = [(stack.reserve_port(), stack.reserve_port(), stack.reserve_port())
             for _ in range(max(0, spec.epp_replicas - 1))]
    return [(grpc_port, health_port, metrics_port), *extra], admin_port


def _start_epps(stack: Stack, spec: StackSpec, engines: _Engines, epps: list[tuple[int, int, int]]) -> None:
    """`kvgate epp` over the engines, one per entry of `epps`."""
    shared = _epp_args(stack, spec, engines)
    peer_sync = _peer_sync_args(stack, spec)
    for i, (grpc_port, health_port, metrics_port) in enumerate(epps):
        stack.start("epp" if i == 0 else f"epp-{i}",
                    [_kvgate(), "epp", "--endpoints", ",".join(engines.endpoints), "--grpc-port", str(grpc_port),
                     "--grpc-health-port", str(health_port), "--metrics-port", str(metrics_port), *shared,
                     *_tracing_args(spec),
                     *(peer_sync[i] if peer_sync else [])])


def _epp_args(stack: Stack, spec: StackSpec, engines: _Engines) -> list[str]:
    """The flags every EPP gets: its config, spec.epp_args, each engine's KV-event sockets (spec's override in
    place of an engine's PUB), the tokenizer, and with leader election the lease."""
    args = (["--config-file", spec.epp_config_file] if spec.epp_config_file else []) + (
        ["--config-text", spec.epp_config_text] if spec.epp_config_text else [])
    override = spec.epp_kv_event_override or {}
    told = [(override.get(i, pub), replay) for i, (pub, replay) in enumerate(engines.event_sockets)]
    args += [*spec.epp_args, *(a for e, (pub, replay) in zip(engines.endpoints, told)
                               for a in ("--kv-events-endpoint", f"{e}={pub},{replay}")),
             *epp_tokenizer_args(spec.model, spec.kv_events, spec.epp_args)]
    if spec.leader_election:
        lease_s, renew_s, retry_s = spec.epp_lease_timings
        args += ["--ha-enable-leader-election", "--ha-lease-file", str(stack.workdir / "epp.lease"),
                 "--ha-lease-duration", f"{lease_s:g}", "--ha-renew-deadline", f"{renew_s:g}",
                 "--ha-retry-period", f"{retry_s:g}"]
    return args


def _peer_sync_args(stack: Stack, spec: StackSpec) -> list[list[str]]:
    """Each active-active EPP's peer-sync flags (none without spec.peer_sync): it publishes its picks on a loopback
    port of its own and subscribes to the others', under the pool's CURVE key (epp/peer_sync_keys.py), shared by
    the replicas, or in clear with spec.epp_peer_sync_insecure."""
    if not spec.peer_sync:
        return []
    sync = [f"tcp://127.0.0.1:{stack.reserve_port()}" for _ in range(spec.epp_replicas)]
    if spec.epp_peer_sync_insecure:
        key = ["--peer-sync-insecure"]
    else:
        from kvgate.epp.peer_sync_keys import write_pool_key

        write_pool_key(stack.workdir / "peer-sync.key_secret")
        key = ["--peer-sync-key-file", str(stack.workdir / "peer-sync.key_secret")]
    return [["--peer-sync-bind", bind, *key, *(a for j, peer in enumerate(sync) if j != i
                                                for a in ("--peer-sync-peer", peer))]
            for i, bind in enumerate(sync)]


def _tracing_args(spec: StackSpec) -> list[str]:
    return ["--otlp-traces-endpoint", spec.otlp_traces_endpoint] if spec.otlp_traces_endpoint else []


def envoy_tracing(spec: StackSpec) -> EnvoyTracing | None:
    """Envoy's tracer: to spec's collector (sampled as OTEL_TRACES_SAMPLER_ARG says), else as the OTEL_* variables
    say; None: no tracing."""
    from_env = tracing_from_env()
    if spec.otlp_traces_endpoint:
        ratio = from_env.sampling_percent / 100 if from_env is not None else 1.0
        return EnvoyTracing.from_endpoint(spec.otlp_traces_endpoint, ratio)
    return from_env


def _envoy_config(spec: StackSpec, engines: _Engines, epps: list[tuple[int, int, int]], admin_port: int,
                  epp_config) -> dict:
    """Envoy's config for spec.envoy_flavor. kvgate's: the pool behind the EPPs (each a host of its EPP cluster
    when there are several), with spec.limits, and fallbacks / the response body through the EPP as its config
    asks."""
    if spec.envoy_flavor == "round-robin":
        from kvgate.common.envoy_config import render_round_robin

        return render_round_robin(spec.host, spec.port, engines.endpoints, admin_port)
    grpc_port, health_port, _ = epps[0]
    if spec.envoy_flavor == "upstream":
        from kvgate.common.upstream_envoy import render_upstream_envoy

        return render_upstream_envoy(spec.port, admin_port, grpc_port)
    route_timeouts, listener_timeouts, breakers = spec.limits or (RouteTimeouts(), ListenerTimeouts(),
                                                                  CircuitBreakers())
    epp_hosts = tuple(("127.0.0.1", g, h) for g, h, _ in epps) if len(epps) > 1 else None
    pool = PoolBackend("local", "127.0.0.1", grpc_port, engines.endpoints, spec.fail_open,
                       epp_health_port=health_port, circuit_breakers=breakers, fallbacks=epp_config.returns_lists,
                       epp_pods=epp_hosts, response=epp_config.response_needs)
    return render_pool_gateway(pool, spec.host, spec.port, admin_port, route_timeouts=route_timeouts,
                               listener_timeouts=listener_timeouts, tracing=envoy_tracing(spec))


def _start_envoy(stack: Stack, config: dict, admin_port: int) -> None:
    (stack.workdir / "envoy.json").write_text(json.dumps(config, indent=2))
    stack.start("envoy", [envoy_binary(), "-c", str(stack.workdir / "envoy.json"), "--log-level", "warn",
                          "--base-id", str(admin_port)])


def _wait_ready(stack: Stack, spec: StackSpec, engines: _Engines, epps: list[tuple[int, int, int]],
                admin_port: int) -> None:
    """Until every engine, EPP and Envoy answers, and then the EPP can route; within spec.startup_timeout."""
    deadline = time.monotonic() + spec.startup_timeout
    for endpoint in engines.endpoints:
        stack.wait_http(f"http://{endpoint}/health", deadline, "engine")
    if spec.with_epp:
        for _, _, metrics_port in epps:
            stack.wait_http(f"http://127.0.0.1:{metrics_port}/metrics", deadline, "EPP")
    stack.wait_http(f"http://127.0.0.1:{admin_port}/ready", deadline, "Envoy")
    health_port = epps[0][1]
    if spec.envoy_flavor == "upstream":  # no health check on the EPP there: wait for the EPP's own readiness
        stack.wait_until(lambda: epp_ready(health_port), deadline, "the EPP to turn ready")
    elif spec.with_epp:
        # the EPP turns ready once it can route; until Envoy's health check saw that, FailClose answers 500
        healthy = 1 if spec.leader_election else spec.epp_replicas
        stack.wait_until(lambda: epp_healthy_in_envoy(admin_port, "epp-local", healthy), deadline,
                         "Envoy to find the EPP ready")


def epp_ready(health_port: int) -> bool:
    """The EPP's gRPC health service answers SERVING for the ext-proc service."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvgate.epp.readiness import EXT_PROC_SERVICE

    with grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=EXT_PROC_SERVICE), timeout=1.0)
        except grpc.RpcError:
            return False
    return answer.status == health_pb2.HealthCheckResponse.SERVING
