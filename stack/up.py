"""`kvgate up`: the whole stack on one machine — N engines, the EPP (standalone) and Envoy, on loopback — until
Ctrl-C or SIGTERM.

kvgate.stack.local_stack starts the stack; kvgate.stack.supervisor restarts a child that dies once it is up (a
replica killed, an engine loop that died, the EPP or Envoy; meanwhile the EPP keeps requests off a dead replica
after two failed scrapes) and ends every child with `kvgate up`, however it ends. A child that dies during
start-up fails `kvgate up` (its log says why). A gateway port that something listens on already (a stack left
running) fails `kvgate up` at once, before anything starts, with a line naming the port and, where /proc tells,
the process that holds it. Only Ctrl-C or SIGTERM stops the stack, and then every child (during start-up too).
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path

from kvgate.common.envoy_config import CircuitBreakers, ListenerTimeouts, RouteTimeouts
from kvgate.stack.local_stack import StackSpec, launch_local_stack
from kvgate.stack.supervisor import Stack


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
    p.add_argument("--otlp-traces-endpoint", metavar="URL", default=None,
                   help="OpenTelemetry: Envoy, the EPP and the engines send request spans to this OTLP/gRPC "
                        "collector (http://HOST:4317), one trace per request; default: OTEL_EXPORTER_OTLP_ENDPOINT, "
                        "else no tracing")
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


def stack_spec(args: argparse.Namespace) -> StackSpec:
    """The stack `kvgate up`'s flags ask for: without --config-file, --profile's EPP config, and kvgate's profile
    turns on KV events."""
    from kvgate.epp.scheduling.config import FALLBACK_CONFIG_YAML, KVGATE_PROFILE_FALLBACK_YAML

    profile_yaml = KVGATE_PROFILE_FALLBACK_YAML if args.profile == "kvgate" else FALLBACK_CONFIG_YAML
    return StackSpec(replicas=args.replicas, model=args.model, backend=args.backend, host=args.host, port=args.port,
                     fail_open=args.failure_mode == "FailOpen", epp_config_file=args.config_file,
                     epp_config_text=None if args.config_file else profile_yaml,
                     engine_args=args.engine_arg, limits=envoy_limits(args), startup_timeout=args.startup_timeout,
                     kv_events=args.kv_events or (args.profile == "kvgate" and not args.config_file),
                     epp_args=["--manifests", args.manifests] if args.manifests else [],
                     otlp_traces_endpoint=args.otlp_traces_endpoint)


def run_up(args: argparse.Namespace) -> int:
    from kvgate.epp.scheduling.config import ConfigError

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
        up = launch_local_stack(stack, stack_spec(args))
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
