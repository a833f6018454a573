"""`kvgate up`: the whole stack on one machine — N engines, the EPP (standalone) and Envoy, on loopback.

Every child runs in its own process group. A child that dies during start-up fails `kvgate up` (its log says
why). Once the stack is up, a child that dies — a replica killed, an engine loop that died, the EPP or Envoy —
is restarted with the same command and ports, after a backoff that doubles from 1 s up to 30 s (and resets once
it has stayed up for a minute), each restart logged; meanwhile the EPP keeps requests off a dead replica (two
failed scrapes). Only Ctrl-C or SIGTERM stops the stack, and then every child.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvgate.envoy_config import (CircuitBreakers, ListenerTimeouts, PoolBackend, Route, RouteTimeouts, envoy_binary,
                                 render_gateway)
from kvgate.processes import free_port, start_group, stop_group, wait_http_ok


def add_up_parser(sub) -> None:
    p = sub.add_parser("up", help="run engines + EPP + Envoy on this machine and print the URL")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--model", default="demo", help="'demo' (default) or a local HF folder")
    p.add_argument("--port", type=int, default=8080, help="the gateway's port (default 8080)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--backend", choices=["torch", "sim"], default="torch")
    p.add_argument("--failure-mode", choices=["FailClose", "FailOpen"], default="FailClose")
    p.add_argument("--config-file", help="EndpointPickerConfig YAML for the EPP")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--engine-arg", action="append", default=[], help="extra flag for every `kvgate serve`")
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
    """Envoy's timeouts and circuit breakers (defaults: kvgate.envoy_config's, sized for LLM traffic)."""
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

    def start(self, name: str, cmd: list[str], env: dict | None = None) -> subprocess.Popen:
        proc = start_group(cmd, self.workdir / f"{name}.log", env)
        self.children.append(Child(name, cmd, env, proc))
        return proc

    def _exit(self, c: Child) -> str:
        return f"{c.name} exited with code {c.proc.returncode} (log: {self.workdir / (c.name + '.log')})"

    def dead(self) -> str | None:
        for c in self.children:
            if c.proc.poll() is not None:
                return self._exit(c)
        return None

    def supervise(self, now: float | None = None) -> list[str]:
        """Restart dead children after their backoff; what happened, as log lines."""
        now = time.monotonic() if now is None else now
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
        for c in reversed(self.children):
            stop_group(c.proc)

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


def epp_healthy_in_envoy(admin_port: int, cluster: str) -> bool:
    """Whether Envoy's health check has found the EPP serving (its /clusters lists the host as healthy)."""
    import httpx

    try:
        text = httpx.get(f"http://127.0.0.1:{admin_port}/clusters", timeout=2).text
    except httpx.HTTPError:
        return False
    return any(line.startswith(f"{cluster}::") and line.endswith("::health_flags::healthy")
               for line in text.splitlines())


def run_up(args: argparse.Namespace) -> int:
    if args.replicas < 1:
        raise SystemExit("kvgate up: --replicas must be >= 1")
    kvgate = str(Path(sys.executable).parent / "kvgate")
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-up-"))
    stack = Stack(workdir)
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        if args.model == "demo" and args.backend == "torch":  # build once, not in N racing processes
            from kvgate.engine.demo import ensure_demo_model

            ensure_demo_model()
        engine_ports = [free_port() for _ in range(args.replicas)]
        threads = str(max(1, (os.cpu_count() or 2) // args.replicas))
        for i, port in enumerate(engine_ports):
            stack.start(f"engine-{i}", [kvgate, "serve", args.model, "--backend", args.backend, "--host", "127.0.0.1",
                                        "--port", str(port), *args.engine_arg], env={"OMP_NUM_THREADS": threads})
        endpoints = [f"127.0.0.1:{p}" for p in engine_ports]
        grpc_port, health_port, metrics_port, admin_port = (free_port() for _ in range(4))
        epp_cmd = [kvgate, "epp", "--endpoints", ",".join(endpoints), "--grpc-port", str(grpc_port),
                   "--grpc-health-port", str(health_port), "--metrics-port", str(metrics_port)]
        if args.config_file:
            epp_cmd += ["--config-file", args.config_file]
        stack.start("epp", epp_cmd)
        route_timeouts, listener_timeouts, breakers = envoy_limits(args)
        pool = PoolBackend("local", "127.0.0.1", grpc_port, endpoints, args.failure_mode == "FailOpen",
                           epp_health_port=health_port, circuit_breakers=breakers)
        config = render_gateway([Route(pool, timeouts=route_timeouts)], args.host, args.port, admin_port,
                                timeouts=listener_timeouts)
        (workdir / "envoy.json").write_text(json.dumps(config, indent=2))
        stack.start("envoy", [envoy_binary(), "-c", str(workdir / "envoy.json"), "--log-level", "warn",
                              "--base-id", str(os.getpid() % 60000 + 1)])
        deadline = time.monotonic() + args.startup_timeout
        for port in engine_ports:
            stack.wait_http(f"http://127.0.0.1:{port}/health", deadline, "engine")
        stack.wait_http(f"http://127.0.0.1:{metrics_port}/metrics", deadline, "EPP")
        stack.wait_http(f"http://127.0.0.1:{admin_port}/ready", deadline, "Envoy")
        # The EPP turns ready once it can route; until Envoy's health check has seen that, FailClose answers 500.
        stack.wait_until(lambda: epp_healthy_in_envoy(admin_port, f"epp-{pool.name}"), deadline,
                         "Envoy to find the EPP ready")
        url = f"http://{args.host}:{args.port}"
        model = args.model
        print(f"kvgate is up: {url}  ({args.replicas} x {args.backend} engine of {model!r}, EPP, Envoy)")
        print(f"  curl {url}/v1/completions -H 'content-type: application/json' "
              f"-d '{{\"model\": \"{model}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'")
        print(f"  EPP metrics: http://127.0.0.1:{metrics_port}/metrics   logs: {workdir}")
        print("Ctrl-C stops everything.", flush=True)
        while not stopping:
            for line in stack.supervise():
                print(f"kvgate up: {line}", file=sys.stderr, flush=True)
            time.sleep(0.2)
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"kvgate up: {exc}", file=sys.stderr)
        return 1
    finally:
        stack.stop()
        print("kvgate up: stopped", flush=True)
