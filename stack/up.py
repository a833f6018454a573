"""`kvgate up`: the whole stack on one machine — N engines, the EPP (standalone) and Envoy, on loopback.

Every child runs in its own process group. A child that dies during start-up fails `kvgate up` (its log says
why). Once the stack is up, a child that dies — a replica killed, an engine loop that died, the EPP or Envoy —
is restarted with the same command and ports, after a backoff that doubles from 1 s up to 30 s (and resets once
it has stayed up for a minute), each restart logged; meanwhile the EPP keeps requests off a dead replica (two
failed scrapes). Each port is held for its child from the moment it is chosen until the stack stops
(kvgate.common.processes.reserve_port), so no other process takes it during a start-up or a restart. Only Ctrl-C or
SIGTERM stops the stack, and then every child (during start-up too).

However `kvgate up` itself ends — SIGKILL, the OOM killer, a crash, or killed in the middle of its graceful
stop — its children and theirs end with it, within kvgate.common.reaper.GRACE_S (0.5 s) and their exit: kvgate.common.processes
hands every child's process group to a reaper process that watches a pipe only `kvgate up` holds. A gateway
port that something listens on already (a stack left running) fails `kvgate up` at once, before anything starts,
with a line naming the port and, where /proc tells, the process that holds it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvgate.common.envoy_config import CircuitBreakers, ListenerTimeouts, PoolBackend, RouteTimeouts, envoy_binary
from kvgate.common.gateway_routes import render_pool_gateway
from kvgate.common.processes import port_taken, reserve_port, start_group, stop_group, wait_http_ok


def add_up_parser(sub) -> None:
    p = sub.add_parser("up", help="run engines + EPP + Envoy on this machine and print the URL")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--model", default="demo", help="'demo' (default) or a local HF folder")
    p.add_argument("--port", type=int, default=8080, help="the gateway's port (default 8080)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--backend", choices=["torch", "sim"], default="torch")
    p.add_argument("--failure-mode", choices=["FailClose", "FailOpen"], default="FailClose")
    p.add_argument("--config-file", help="EndpointPickerConfig YAML for the EPP (default: --profile's, with two "
                                         "fallbacks per decision, which kvgate's Envoy retries on)")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--engine-arg", action="append", default=[],
                   help="extra flag for every `kvgate serve`, one per --engine-arg (a flag that starts with a "
                        "dash as --engine-arg=--enable-lora)")
    p.add_argument("--manifests", help="YAML with InferenceObjective / InferenceModelRewrite objects for the EPP "
                                       "(what a cluster's pool would have), e.g. a model name split across adapters")
    p.add_argument("--profile", choices=["kvgate", "upstream"], default="kvgate",
                   help="the EPP's scorers without --config-file: kvgate (default; for kvgate engines: affinity to "
                        "the engine that holds the prompt, on its exact prefill backlog; precise prefix from KV "
                        "events; prefix groups spread; ties broken on the TTFT each engine's own latency model "
                        "predicts; turns on --kv-events) or upstream (queue 2, kv-cache 2, prefix 3, the EPP's own "
                        "default); both with two fallbacks per decision")
    p.add_argument("--kv-events", action="store_true",
                   help="engines publish KV-cache events (each on its own loopback ports) and the EPP subscribes: "
                        "what a --config-file naming precise-prefix-cache-scorer needs")
    add_envoy_limit_flags(p)
    p.set_defaults(func=run_up)


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def add_envoy_limit_flags(p) -> None:
    """Envoy's timeouts and circuit breakers (defaults: kvgate.common.envoy_config's, sized for LLM traffic)."""
    timeouts, listener, breakers = RouteTimeouts(), ListenerTimeouts(), CircuitBreakers()
    g = p.add_argument_group("Envoy limits")
    g.add_argument("--request-timeout", type=_positive(float), default=timeouts.request_s, metavar="SECONDS",
                   help=f"whole-request limit, long generations included (default {timeouts.request_s:g})")
    g.add_argument("--stream-idle-timeout", type=_positive(float), default=listener.stream_idle_s, metavar="SECONDS",
                   help=f"a stream with no byte either way this long is reset (default {listener.stream_idle_s:g})")
    g.add_argument("--request-headers-timeout", type=_positive(float), default=listener.request_headers_s,
                   metavar="SECONDS", help="time a client has to send its request headers "
                                           f"(default {listener.request_headers_s:g})")
    for name in ("max_requests", "max_pending_requests", "max_connections", "max_retries"):
        g.add_argument(f"--{name.replace('_', '-')}", type=_positive(int), default=getattr(breakers, name),
                       help=f"circuit breaker of the engines' cluster (default {getattr(breakers, name)})")


def envoy_limits(args: argparse.Namespace) -> tuple[RouteTimeouts, ListenerTimeouts, CircuitBreakers]:
    return (RouteTimeouts(request_s=args.request_timeout),
            ListenerTimeouts(request_headers_s=args.request_headers_timeout, stream_idle_s=args.stream_idle_timeout),
            CircuitBreakers(args.max_requests, args.max_pending_requests, args.max_connections, args.max_retries))


@dataclass
class Child:
    name: str
    cmd: list[str]
    env: dict | None
    proc: subprocess.Popen
    started_at: float = field(default_factory=time.monotonic)
    restarts: int = 0  # in a row: reset once the child has stayed up for STABLE_S
    restart_at: float | None = None  # when a dead child is started again


class Stack:
    RESTART_BASE_S = 1.0
    RESTART_CAP_S = 30.0
    STABLE_S = 60.0

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.children: list[Child] = []
        self.stopping = False  # set by stop(): nothing is restarted any more
        self.interrupted: str | None = None  # a signal's name, set by `kvgate up`'s handler: start-up gives up
        self._lock = threading.Lock()  # supervise() and stop() may run on different threads (benchmarks)
        self._reserved: list[socket.socket] = []  # the children's ports, held until stop(): reserve_port()

    def reserve_port(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """A port (`port` 0: a free one) that only this stack's children may listen on, until stop(): a child's
        start-up, and its restarts, cannot lose it to another process (kvgate.common.processes.reserve_port)."""
        held = reserve_port(host, port)
        self._reserved.append(held)
        return held.getsockname()[1]

    def start(self, name: str, cmd: list[str], env: dict | None = None) -> subprocess.Popen:
        proc = start_group(cmd, self.workdir / f"{name}.log", env)
        self.children.append(Child(name, cmd, env, proc))
        return proc

    def _exit(self, c: Child) -> str:
        return f"{c.name} exited with code {c.proc.returncode} (log: {self.workdir / (c.name + '.log')})"

    def dead(self) -> str | None:
        if self.interrupted:
            return f"interrupted by {self.interrupted}"
        for c in self.children:
            if c.proc.poll() is not None:
                return self._exit(c)
        return None

    def supervise(self, now: float | None = None) -> list[str]:
        """Restart dead children after their backoff; what happened, as log lines."""
        with self._lock:
            return [] if self.stopping else self._supervise(time.monotonic() if now is None else now)

    def _supervise(self, now: float) -> list[str]:
        said = []
        for c in self.children:
            if c.restart_at is not None:
                if now >= c.restart_at:
                    c.proc = start_group(c.cmd, self.workdir / f"{c.name}.log", c.env, append=True)
                    c.started_at, c.restart_at = now, None
                    said.append(f"{c.name} restarted (restart {c.restarts})")
            elif c.proc.poll() is not None:
                if now - c.started_at >= self.STABLE_S:
                    c.restarts = 0
                delay = min(self.RESTART_CAP_S, self.RESTART_BASE_S * 2 ** c.restarts)
                c.restarts += 1
                c.restart_at = now + delay
                said.append(f"{self._exit(c)}; restarting in {delay:g} s")
        return said

    def stop(self) -> None:
        with self._lock:
            self.stopping = True
        for c in reversed(self.children):
            stop_group(c.proc)
        for held in self._reserved:
            held.close()
        self._reserved.clear()

    def wait_http(self, url: str, deadline: float, what: str) -> None:
        wait_http_ok(url, max(deadline - time.monotonic(), 0.1), self.dead, what)

    def wait_until(self, ready, deadline: float, what: str) -> None:
        """Poll `ready()` until true; RuntimeError if a child dies, TimeoutError past `deadline`."""
        while not ready():
            problem = self.dead()
            if problem:
                raise RuntimeError(f"{problem} while waiting for {what}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            time.sleep(0.1)


# Active-passive EPPs on one machine (launch_local_stack's epp_leader_election): lease duration, renew deadline and
# retry period, seconds — a killed leader's follower leads about 2 s later (the Lease holds whole seconds).
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


def launch_local_stack(stack: Stack, *, replicas: int, model: str, backend: str, host: str, port: int,
                       fail_open: bool = False, epp_config_file: str | None = None,
                       epp_config_text: str | None = None, engine_args: list[str] = (),
                       limits: tuple[RouteTimeouts, ListenerTimeouts, CircuitBreakers] | None = None,
                       envoy_flavor: str = "kvgate", startup_timeout: float = 300.0,
                       engine_hosts: list[str] | None = None,
                       engine_args_for: Callable[[int, str], list[str]] | None = None,
                       epp_args: list[str] = (), kv_events: bool = False,
                       epp_kv_event_override: dict[int, str] | None = None, epp_replicas: int = 1,
                       epp_leader_election: bool = False, epp_peer_sync: bool = True,
                       epp_peer_sync_insecure: bool = False,
                       epp_lease_timings: tuple[float, float, float] = EPP_LEASE_TIMINGS) -> LocalStack:
    """Start N engines, the EPP over them and Envoy (`kvgate`: kvgate's rendered config; `upstream`: the stock
    upstream-shaped one; `round-robin`: Envoy's own round-robin over the engines and no EPP, a benchmark's
    baseline) in `stack`, and wait until a request can be routed. An EPP config whose picker returns
    fallbacks gets kvgate's override_host route, whose retries walk them. `engine_hosts` puts each engine on its
    own loopback address (127.0.0.x: endpoints that differ by address, as pods do);
    `engine_args_for(i, host)` adds flags to engine i; `epp_args` to the EPP. `kv_events`: every engine publishes
    KV-cache events on a PUB and a replay socket of its own, bound on the IPv6 loopback (vLLM binds an address
    with `::` or `*`, and connects to any other), and the EPP is told each one (--kv-events-endpoint);
    `epp_kv_event_override` tells it another PUB address for engine i (`kvgate bench hostile` binds a rogue
    publisher there). `epp_replicas` > 1 (kvgate's Envoy config only): that many EPPs over the same engines, each
    a host of Envoy's EPP cluster, serving at once (active-active; each sees the engines' metrics and KV events,
    and, with `epp_peer_sync`, the others' picks: epp/peer_sync.py, under a pool key made in the stack's workdir,
    or in clear with `epp_peer_sync_insecure`; without, only its own in-flight requests).
    `epp_leader_election` with `epp_replicas` > 1: active-passive instead — the EPPs elect a leader over a lease
    file in the stack's workdir (`--ha-lease-file`), with `epp_lease_timings` (lease duration, renew deadline,
    retry period, seconds); only the leader answers SERVING, so start-up waits for one EPP healthy in Envoy.
    Raises RuntimeError if a child dies, TimeoutError past `startup_timeout`."""
    from kvgate.epp.scheduling.config import load_config

    epp_config = load_config(epp_config_file, epp_config_text)  # ConfigError before anything starts
    if epp_replicas > 1 and envoy_flavor != "kvgate":
        raise ValueError("several EPP replicas need kvgate's Envoy config (an EPP cluster of several hosts)")
    leader_election = epp_leader_election and epp_replicas > 1
    taken = port_taken(host, port)  # else Envoy alone would fail, after the engines had started, in its log
    if taken:
        raise RuntimeError(taken)
    stack.reserve_port(host, port)  # held too: the engines may take a while, and Envoy binds it last
    epp_config_args = (["--config-file", epp_config_file] if epp_config_file else []) + (
        ["--config-text", epp_config_text] if epp_config_text else [])
    kvgate = str(Path(sys.executable).parent / "kvgate")
    if model == "demo" and backend == "torch":  # build once, not in N racing processes
        from kvgate.common.demo import ensure_demo_model

        ensure_demo_model()
    hosts = list(engine_hosts) if engine_hosts else ["127.0.0.1"] * replicas
    engine_ports = [stack.reserve_port(h) for h in hosts]
    threads = str(max(1, (os.cpu_count() or 2) // replicas))
    endpoints = [f"{h}:{p}" for h, p in zip(hosts, engine_ports)]
    event_sockets = [(f"tcp://[::1]:{stack.reserve_port('::1')}", f"tcp://[::1]:{stack.reserve_port('::1')}")
                     for _ in engine_ports] \
        if kv_events else []
    for i, (host_i, engine_port) in enumerate(zip(hosts, engine_ports)):
        extra = engine_args_for(i, host_i) if engine_args_for else []
        if kv_events:
            pub, replay = event_sockets[i]
            extra = [*extra, "--kv-events-config", json.dumps(
                {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub, "replay_endpoint": replay})]
        stack.start(f"engine-{i}", [kvgate, "serve", model, "--backend", backend, "--host", host_i,
                                    "--port", str(engine_port), *engine_args, *extra],
                    env={"OMP_NUM_THREADS": threads})
    told = [((epp_kv_event_override or {}).get(i, pub), replay) for i, (pub, replay) in enumerate(event_sockets)]
    epp_args = [*epp_args, *(a for e, (pub, replay) in zip(endpoints, told)
                             for a in ("--kv-events-endpoint", f"{e}={pub},{replay}")),
                *epp_tokenizer_args(model, kv_events, epp_args)]
    if leader_election:
        lease_s, renew_s, retry_s = epp_lease_timings
        epp_args = [*epp_args, "--ha-enable-leader-election", "--ha-lease-file", str(stack.workdir / "epp.lease"),
                    "--ha-lease-duration", f"{lease_s:g}", "--ha-renew-deadline", f"{renew_s:g}",
                    "--ha-retry-period", f"{retry_s:g}"]
    grpc_port, health_port, metrics_port, admin_port = (stack.reserve_port() for _ in range(4))
    extra_epps = [(stack.reserve_port(), stack.reserve_port(), stack.reserve_port())
                  for _ in range(max(0, epp_replicas - 1))]
    with_epp = envoy_flavor != "round-robin"
    # active-active replicas share their picks (epp/peer_sync.py), each publishing on a loopback port of its own
    sync = [f"tcp://127.0.0.1:{stack.reserve_port()}" for _ in range(epp_replicas)] \
        if epp_peer_sync and epp_replicas > 1 and not leader_election else []
    sync_key = []
    if sync and epp_peer_sync_insecure:
        sync_key = ["--peer-sync-insecure"]
    elif sync:  # the pool's CURVE key, shared by the replicas (epp/peer_sync_keys.py)
        from kvgate.epp.peer_sync_keys import write_pool_key

        write_pool_key(stack.workdir / "peer-sync.key_secret")
        sync_key = ["--peer-sync-key-file", str(stack.workdir / "peer-sync.key_secret")]
    if with_epp:
        for i, (name, (grpc_i, health_i, metrics_i)) in enumerate(
                [("epp", (grpc_port, health_port, metrics_port)),
                 *((f"epp-{i + 1}", ports) for i, ports in enumerate(extra_epps))]):
            peer_args = [*("--peer-sync-bind", sync[i]), *sync_key,
                         *(a for j, peer in enumerate(sync) if j != i for a in ("--peer-sync-peer", peer))] \
                if sync else []
            stack.start(name, [kvgate, "epp", "--endpoints", ",".join(endpoints), "--grpc-port", str(grpc_i),
                               "--grpc-health-port", str(health_i), "--metrics-port", str(metrics_i),
                               *epp_config_args, *epp_args, *peer_args])
    if envoy_flavor == "round-robin":
        from kvgate.common.envoy_config import render_round_robin

        config = render_round_robin(host, port, endpoints, admin_port)
    elif envoy_flavor == "upstream":
        from kvgate.common.upstream_envoy import render_upstream_envoy

        config = render_upstream_envoy(port, admin_port, grpc_port)
    else:
        route_timeouts, listener_timeouts, breakers = limits or (RouteTimeouts(), ListenerTimeouts(),
                                                                 CircuitBreakers())
        epp_hosts = tuple(("127.0.0.1", g, h) for g, h, _ in [(grpc_port, health_port, None), *extra_epps]) \
            if extra_epps else None
        pool = PoolBackend("local", "127.0.0.1", grpc_port, endpoints, fail_open, epp_health_port=health_port,
                           circuit_breakers=breakers, fallbacks=epp_config.returns_lists, epp_pods=epp_hosts,
                           response_body=epp_config.needs_response_body)
        config = render_pool_gateway(pool, host, port, admin_port, route_timeouts=route_timeouts,
                                     listener_timeouts=listener_timeouts)
    (stack.workdir / "envoy.json").write_text(json.dumps(config, indent=2))
    stack.start("envoy", [envoy_binary(), "-c", str(stack.workdir / "envoy.json"), "--log-level", "warn",
                          "--base-id", str(admin_port)])
    deadline = time.monotonic() + startup_timeout
    for endpoint in endpoints:
        stack.wait_http(f"http://{endpoint}/health", deadline, "engine")
    if with_epp:
        for port_i in [metrics_port, *(m for _, _, m in extra_epps)]:
            stack.wait_http(f"http://127.0.0.1:{port_i}/metrics", deadline, "EPP")
    stack.wait_http(f"http://127.0.0.1:{admin_port}/ready", deadline, "Envoy")
    if envoy_flavor == "upstream":  # no health check on the EPP there: wait for the EPP's own readiness
        stack.wait_until(lambda: epp_ready(health_port), deadline, "the EPP to turn ready")
    elif with_epp:  # the EPP turns ready once it can route; until Envoy's health check saw that, FailClose answers 500
        stack.wait_until(lambda: epp_healthy_in_envoy(admin_port, "epp-local", 1 if leader_election else epp_replicas),
                         deadline, "Envoy to find the EPP ready")
    return LocalStack(stack, f"http://{host}:{port}", model, engine_ports, grpc_port, health_port, metrics_port,
                      admin_port, envoy_flavor, hosts, event_sockets, [m for _, _, m in extra_epps],
                      [g for g, _, _ in extra_epps], [h for _, h, _ in extra_epps])


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


def run_up(args: argparse.Namespace) -> int:
    from kvgate.epp.scheduling.config import FALLBACK_CONFIG_YAML, KVGATE_PROFILE_FALLBACK_YAML, ConfigError

    if args.replicas < 1:
        raise SystemExit("kvgate up: --replicas must be >= 1")
    stack = Stack(Path(tempfile.mkdtemp(prefix="kvgate-up-")))
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True
        stack.interrupted = signal.Signals(signum).name  # still starting: the wait for readiness gives up

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        up = launch_local_stack(stack, replicas=args.replicas, model=args.model, backend=args.backend,
                                host=args.host, port=args.port, fail_open=args.failure_mode == "FailOpen",
                                epp_config_file=args.config_file,
                                epp_config_text=None if args.config_file else (
                                    KVGATE_PROFILE_FALLBACK_YAML if args.profile == "kvgate" else FALLBACK_CONFIG_YAML),
                                engine_args=args.engine_arg, limits=envoy_limits(args),
                                startup_timeout=args.startup_timeout,
                                kv_events=args.kv_events or (args.profile == "kvgate" and not args.config_file),
                                epp_args=["--manifests", args.manifests] if args.manifests else [])
        print(f"kvgate is up: {up.url}  ({args.replicas} x {args.backend} engine of {args.model!r}, EPP, Envoy)")
        print(f"  curl {up.url}/v1/completions -H 'content-type: application/json' "
              f"-d '{{\"model\": \"{args.model}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'")
        print(f"  EPP metrics: http://127.0.0.1:{up.metrics_port}/metrics   logs: {stack.workdir}")
        print("Ctrl-C stops everything.", flush=True)
        while not stopping:
            for line in stack.supervise():
                print(f"kvgate up: {line}", file=sys.stderr, flush=True)
            time.sleep(0.2)
        return 0
    except (RuntimeError, TimeoutError, ConfigError) as exc:
        print(f"kvgate up: {exc}", file=sys.stderr)
        return 1
    finally:
        stack.stop()
        print("kvgate up: stopped", flush=True)
