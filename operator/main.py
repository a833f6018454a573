"""`kvgate operator`: the kopf-based operator for ModelServers, InferencePools and Gateways of class kvgate.

Runs in-process with kopf (standalone: no peering objects), against the in-cluster service account or
$KUBECONFIG. With `--leader-election enabled` several replicas run and the one holding a Lease reconciles
(leadership.py). What it watches is in watches.py, how it reconciles in reconciler.py (one *_reconciler.py per kind);
how objects are built is in modelserver.py, pool.py, gateway.py.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import threading
import time

DEFAULT_KVGATE_IMAGE = "ghcr.io/kvgate/kvgate:latest"
DEFAULT_ENVOY_IMAGE = "envoyproxy/envoy:v1.36-latest"


def add_operator_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("operator", help="run the Kubernetes operator (ModelServer, InferencePool EPPs, Gateways)",
                       description="Reconcile ModelServers into engine Deployments, run an EPP per kvgate "
                                   "InferencePool and an Envoy per Gateway of class controllerName "
                                   "kvgate.dev/gateway-controller. Uses the in-cluster service account, else "
                                   "$KUBECONFIG.")
    p.add_argument("--namespace", default=None,
                   help="watch only this namespace (default: all namespaces)")
    p.add_argument("--engine-image", default=DEFAULT_KVGATE_IMAGE,
                   help="image of the engine pods when a ModelServer names none (default %(default)s)")
    p.add_argument("--vllm-image", default=None, metavar="IMAGE",
                   help="image of ModelServers with engine.type vllm that name none (default: none, so each must "
                        "name one under an --allow-image-prefix); runs as uid 10001 on a read-only root")
    p.add_argument("--sglang-image", default=None, metavar="IMAGE",
                   help="image of ModelServers with engine.type sglang that name none (default: none)")
    p.add_argument("--epp-image", default=DEFAULT_KVGATE_IMAGE, help="image of the EPP pods (default %(default)s)")
    p.add_argument("--envoy-image", default=DEFAULT_ENVOY_IMAGE,
                   help="image of the Gateways' Envoy pods (default %(default)s)")
    p.add_argument("--envoy-service-type", default="ClusterIP", choices=["ClusterIP", "NodePort", "LoadBalancer"],
                   help="type of each Gateway's Envoy Service (default %(default)s)")
    p.add_argument("--epp-address-mode", default="service", choices=["service", "pod-ip"],
                   help="how Envoy reaches a pool's EPP: 'service' (default) by the EPP Service's DNS name; "
                        "'pod-ip' by a ready EPP pod's IP, for clusters without Service routing (e.g. the "
                        "e2e rig, which has no kube-proxy); the Envoy config then follows the EPP pod")
    p.add_argument("--epp-network-policy", default="enabled", choices=["enabled", "disabled"],
                   help="write a NetworkPolicy per managed pool's EPP admitting ext-proc and health traffic only "
                        "from the pool's Gateways and metrics scrapes only from --epp-metrics-from (default "
                        "%(default)s; 'disabled' leaves policies already written in place)")
    p.add_argument("--epp-high-availability", default="disabled", choices=["enabled", "disabled"],
                   help="let pools ask for several EPP replicas (annotation kvgate.dev/epp-replicas, 1 to 5): "
                        "active-passive by a Lease, spread across nodes, with a PodDisruptionBudget; the operator "
                        "then needs Lease and PodDisruptionBudget permissions (the chart's "
                        "eppHighAvailability.enabled) (default %(default)s)")
    p.add_argument("--epp-metrics-from", type=_metrics_peers, default=(), metavar="PEERS",
                   help="NetworkPolicy peers (a YAML or JSON list) allowed to scrape every EPP's metrics port, e.g. "
                        "'[{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: monitoring}}}]' "
                        "(default: none)")
    p.add_argument("--allow-host-path", action="store_true",
                   help="let ModelServers mount node directories (model.hostPath); off by default, as anyone who "
                        "may create a ModelServer could then read any node path, '/' included; each use is logged")
    p.add_argument("--allow-image-prefix", action="append", default=[], metavar="PREFIX",
                   help="let ModelServers run spec.image values under PREFIX (repeatable; matched at a '/', ':' or "
                        "'@' boundary, e.g. registry.example/kvgate; '*' allows any image); by default only "
                        "--engine-image runs; each use is logged")
    p.add_argument("--otlp-traces-endpoint", metavar="URL", default=None,
                   help="OpenTelemetry: the Gateways' Envoys, the pools' EPPs and the ModelServers' engines send "
                        "request spans to this OTLP/gRPC collector (http://HOST:4317; EPP and engine pods get OTEL_* "
                        "env, vLLM engines also its --otlp-traces-endpoint); default: no tracing")
    p.add_argument("--trace-sampling-ratio", type=_ratio, default=1.0, metavar="RATIO",
                   help="with --otlp-traces-endpoint: the share of requests without a sampled traceparent that are "
                        "traced, in [0, 1] (parentbased_traceidratio; default 1)")
    p.add_argument("--autoscale-interval-seconds", type=_interval, default=15.0, metavar="SECONDS",
                   help="look at autoscaled ModelServers (spec.maxReplicas) this often, in [1, 600] (default "
                        "%(default)s, as HPA's sync period)")
    p.add_argument("--keda-prometheus-address", type=_http_url, default=None, metavar="URL",
                   help="the Prometheus (http(s)://HOST:PORT) that KEDA's ScaledObjects query, for ModelServers "
                        "with autoscaling.provider keda (default: none; such ModelServers then get a condition)")
    p.add_argument("--envoy-config-source", default="files", choices=["files", "xds"],
                   help="how the Gateways' Envoys get their config: 'files', from their mounted ConfigMap (changes "
                        "arrive with the kubelet's ConfigMap sync, up to a minute); 'xds', over ADS from the "
                        "operator's xDS server (every replica serves it; needs --xds-address) "
                        "(default %(default)s)")
    p.add_argument("--xds-address", type=_xds_address, default=None, metavar="HOST:PORT",
                   help="with --envoy-config-source xds: where the Envoys reach the operator's xDS server (its "
                        "Service, e.g. kvgate-xds.kvgate-system.svc.cluster.local:18000)")
    p.add_argument("--envoy-bind-address", default="any", choices=["any", "pod-ip"],
                   help="with --envoy-config-source xds: where the Envoys bind their listeners: 'any' (0.0.0.0, "
                        "the default) or 'pod-ip' (the pod's own IP, for clusters whose pods share one network "
                        "namespace, e.g. the e2e rig)")
    p.add_argument("--xds-port", type=_port, default=18000,
                   help="port of the xDS server, plain gRPC (default %(default)s; admit only the Gateways' Envoy "
                        "pods to it, as the chart's NetworkPolicy does)")
    p.add_argument("--xds-host", default="0.0.0.0", help="address of the xDS server (default %(default)s)")
    p.add_argument("--xds-max-streams", type=_stream_limit, default=1000,
                   help="at most this many Envoy streams at once; more are refused (default %(default)s)")
    p.add_argument("--resync-seconds", type=float, default=15.0,
                   help="reconcile everything again this often (default %(default)s)")
    p.add_argument("--liveness-port", type=int, default=None,
                   help="serve kopf's liveness probe at http://HOST:PORT/healthz (default: off)")
    p.add_argument("--liveness-host", default="0.0.0.0",
                   help="address of the liveness endpoint (default %(default)s: every interface of the pod)")
    p.add_argument("--metrics-port", type=_port, default=None,
                   help="serve the operator's Prometheus metrics (kvgate_operator_leader, the autoscaler's "
                        "kvgate_operator_autoscale_*) at http://HOST:PORT/metrics, HOST being --liveness-host "
                        "(default: off)")
    add_leader_election_flags(p)
    p.set_defaults(func=run_operator)
    return p


def add_leader_election_flags(p: argparse.ArgumentParser) -> None:
    from kvgate.common.lease_election import (DEFAULT_LEASE_DURATION_S, DEFAULT_RENEW_DEADLINE_S,
                                              DEFAULT_RETRY_PERIOD_S, MAX_LEASE_DURATION_S)
    from kvgate.operator.leadership import OPERATOR_LEASE_NAME

    g = p.add_argument_group("high availability (operator/leadership.py)")
    g.add_argument("--leader-election", default="disabled", choices=["enabled", "disabled"],
                   help="run as one of several replicas: the one holding a coordination.k8s.io Lease reconciles, "
                        "the others keep their watches warm and take over when it stops renewing (default "
                        "%(default)s: this replica always reconciles; the chart enables it)")
    g.add_argument("--leader-election-namespace", default=None, metavar="NAMESPACE",
                   help="the Lease's namespace (default: $POD_NAMESPACE, else --namespace)")
    g.add_argument("--leader-election-lease-name", type=_object_name, default=OPERATOR_LEASE_NAME, metavar="NAME",
                   help="the Lease's name; replicas with the same name and namespace elect one (default %(default)s)")
    g.add_argument("--leader-election-lease-duration", type=_seconds, default=DEFAULT_LEASE_DURATION_S,
                   metavar="SECONDS", help="a standby takes over a leader that has not renewed for this long "
                   f"(default %(default)g s, at most {MAX_LEASE_DURATION_S:g}); a leader that stops releases at once")
    g.add_argument("--leader-election-renew-deadline", type=_seconds, default=DEFAULT_RENEW_DEADLINE_S,
                   metavar="SECONDS", help="a leader that could not renew for this long stops writing and steps "
                   "down (default %(default)g s; below the lease duration)")
    g.add_argument("--leader-election-retry-period", type=_seconds, default=DEFAULT_RETRY_PERIOD_S,
                   metavar="SECONDS", help="how often standbys try and the leader renews (default %(default)g s; "
                   "below the renew deadline)")


def _port(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port from 1 to 65535, got {text[:20]!r}")
    return int(text)


def _object_name(text: str) -> str:
    """A Kubernetes object name (a DNS subdomain: lowercase alphanumerics, '-' and '.', at most 253)."""
    import re

    if len(text) > 253 or not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", text):
        raise argparse.ArgumentTypeError(f"must be a Kubernetes object name (DNS subdomain), got {text[:60]!r}")
    return text


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def leader_election_namespace(args: argparse.Namespace) -> str:
    """The Lease's namespace; ConfigError (kvgate's one-line exit 2) when the flags cannot run an election."""
    from kvgate.common.errors import ConfigError
    from kvgate.common.lease_election import MAX_LEASE_DURATION_S

    if not (0 < args.leader_election_retry_period < args.leader_election_renew_deadline
            < args.leader_election_lease_duration <= MAX_LEASE_DURATION_S):
        raise ConfigError("leader election needs --leader-election-retry-period < --leader-election-renew-deadline "
                          f"< --leader-election-lease-duration <= {MAX_LEASE_DURATION_S:g} s")
    namespace = args.leader_election_namespace or os.environ.get("POD_NAMESPACE") or args.namespace
    if not namespace:
        raise ConfigError("--leader-election enabled needs the Lease's namespace: --leader-election-namespace, "
                          "$POD_NAMESPACE (the chart sets it) or --namespace")
    return namespace


def _bounded_float(text: str, low: float, high: float, what: str = "a number") -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not low <= value <= high:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be {what} in [{low:g}, {high:g}], got {text!r}")
    return value


def _ratio(text: str) -> float:
    return _bounded_float(text, 0.0, 1.0)


def _interval(text: str) -> float:
    return _bounded_float(text, 1.0, 600.0, "a number of seconds")


def _http_url(text: str) -> str:
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - raises on a port out of range
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or len(text) > 2048:
        raise argparse.ArgumentTypeError(f"must be an http(s)://HOST[:PORT] URL, got {text[:100]!r}")
    return text


def _bounded_int(text: str, low: int, high: int) -> int:
    if not text.isdigit() or not low <= int(text) <= high:
        raise argparse.ArgumentTypeError(f"must be an integer in [{low}, {high}], got {text!r}")
    return int(text)


def _port(text: str) -> int:
    return _bounded_int(text, 1, 65535)


def _stream_limit(text: str) -> int:
    return _bounded_int(text, 1, 100_000)


def _xds_address(text: str):
    from kvgate.operator.xds.xds_files import XdsAddress

    try:
        return XdsAddress.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _metrics_peers(text: str) -> tuple[dict, ...]:
    from kvgate.operator.network_policy import parse_peers

    try:
        return tuple(parse_peers(text, "--epp-metrics-from"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def run_operator(args: argparse.Namespace) -> int:
    import kopf

    from kvgate.operator.apply import Kube, load_config
    from kvgate.operator.config import OperatorConfig, TraceExport
    from kvgate.operator.reconciler import Reconciler
    from kvgate.operator.tenancy import TenantPolicy
    from kvgate.operator.watches import register

    if getattr(args, "log_level", "warning") == "warning":  # the CLI's quiet default: an operator says what it does
        logging.getLogger("kvgate.operator").setLevel(logging.INFO)
    config = OperatorConfig(engine_image=args.engine_image, epp_image=args.epp_image, envoy_image=args.envoy_image,
                            namespace=args.namespace, epp_address_mode=args.epp_address_mode,
                            envoy_service_type=args.envoy_service_type, resync_s=args.resync_seconds,
                            network_policy=args.epp_network_policy == "enabled",
                            epp_high_availability=args.epp_high_availability == "enabled",
                            epp_metrics_from=args.epp_metrics_from,
                            vllm_image=args.vllm_image, sglang_image=args.sglang_image,
                            tenant_policy=TenantPolicy(allow_host_path=args.allow_host_path,
                                                       image_prefixes=tuple(args.allow_image_prefix)),
                            tracing=TraceExport(args.otlp_traces_endpoint, args.trace_sampling_ratio)
                            if args.otlp_traces_endpoint else None,
                            autoscale_interval_s=args.autoscale_interval_seconds,
                            keda_prometheus_address=args.keda_prometheus_address,
                            envoy_config_source=args.envoy_config_source, xds_address=args.xds_address,
                            envoy_bind_address=args.envoy_bind_address)
    if args.envoy_config_source == "xds" and args.xds_address is None:
        print("kvgate operator: --envoy-config-source xds needs --xds-address HOST:PORT", file=sys.stderr)
        return 2
    if args.allow_host_path or args.allow_image_prefix:
        logging.getLogger("kvgate.operator").warning(
            "ModelServers may use: %s", ", ".join((["hostPath volumes"] if args.allow_host_path else [])
                                                  + [f"images under {p!r}" for p in args.allow_image_prefix]))
    metrics = leadership = None
    namespace = leader_election_namespace(args) if args.leader_election == "enabled" else None
    if args.metrics_port:
        from kvgate.operator.metrics import OperatorMetrics

        metrics = OperatorMetrics()
        metrics.serve(args.liveness_host, args.metrics_port)
    if namespace is not None:
        from kubernetes.client import CoordinationV1Api

        from kvgate.common.lease_election import default_identity
        from kvgate.operator.leadership import OperatorLeadership

        leadership = OperatorLeadership(
            CoordinationV1Api(load_config()), namespace, default_identity("kvgate-operator"),
            lease_name=args.leader_election_lease_name, lease_duration=args.leader_election_lease_duration,
            renew_deadline=args.leader_election_renew_deadline, retry_period=args.leader_election_retry_period,
            metrics=metrics)
    liveness = f"http://{args.liveness_host}:{args.liveness_port}/healthz" if args.liveness_port else None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # kopf, in its own thread, leaves the signals to us
        signal.signal(sig, lambda *_: stop.set())

    autoscale_metrics = metrics.autoscale if metrics is not None else None
    current: list = []  # the running reconciler, woken when the Envoys' xDS answers change

    if args.envoy_config_source == "xds":  # every replica serves xDS, leader or not
        from kvgate.operator.reconciler import GATEWAYS_KEY
        from kvgate.operator.xds.serve import start_xds

        start_xds(Kube(), args.namespace, args.xds_host, args.xds_port, args.xds_max_streams,
                  on_reports=lambda *_: current and current[-1].queue.add(GATEWAYS_KEY))

    def serve_once() -> None:
        if leadership is None:
            reconciler = Reconciler(Kube(), config, autoscale_metrics)
        else:  # writes fenced by the Lease; the worker waits while this replica stands by
            from kvgate.operator.fencing import FencedKube

            reconciler = Reconciler(FencedKube(leadership.may_write), config, autoscale_metrics)
            leadership.follow(reconciler)
        current[:] = [reconciler]

        def run() -> None:
            try:
                kopf.run(registry=register(kopf.OperatorRegistry(), reconciler), standalone=True,
                         clusterwide=args.namespace is None, namespaces=[args.namespace] if args.namespace else (),
                         liveness_endpoint=liveness, stop_flag=stop)
            finally:
                reconciler.stop()

        run_reactor(run, reconciler.stopped)

    if leadership is not None:
        leadership.start()
    runner = threading.Thread(target=serve_until_stopped, args=(serve_once, stop), name="kvgate-operator-kopf")
    runner.start()
    try:
        while runner.is_alive():
            runner.join(0.5)
    finally:
        if leadership is not None:  # after the reactor: nothing writes once the Lease is released
            leadership.stop()
        if metrics is not None:
            metrics.close()
    return 0


# kopf waits without a time limit for its tasks to end once its reactor stops, and a watch retrying a request can
# outlive that by minutes (seen in tests/e2e/test_control_plane_faults_e2e.py under a full `make test`: the
# cleanup ran at the API server's restart, watches kept retrying, kopf.run did not return, so no restart came
# and a scale was not followed for 120 s). A reactor whose cleanup ran is given this long to return, then left to
# end by itself (a daemon thread: its handlers feed a stopped reconciler) while a fresh one starts.
REACTOR_SHUTDOWN_GRACE_S = 10.0


def run_reactor(run, cleaned_up: threading.Event, grace_s: float = REACTOR_SHUTDOWN_GRACE_S) -> None:
    """run() (kopf.run) in a daemon thread; returns when it returns (raising what it raised), or grace_s after
    `cleaned_up` is set while it still runs."""
    error: list[BaseException] = []

    def target() -> None:
        try:
            run()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            error.append(exc)

    thread = threading.Thread(target=target, name="kvgate-operator-reactor", daemon=True)
    thread.start()
    cleanup_seen = None
    while thread.is_alive():
        thread.join(0.2)
        if cleanup_seen is None and cleaned_up.is_set():
            cleanup_seen = time.monotonic()
        if cleanup_seen is not None and thread.is_alive() and time.monotonic() - cleanup_seen >= grace_s:
            logging.getLogger("kvgate.operator").warning(
                "the stopped reactor has not returned %.0f s after its cleanup (a watch still retrying); "
                "leaving it to end by itself", grace_s)
            return
    if error:
        raise error[0]


# kopf ends its whole reactor when one watch fails for good, e.g. a 404 for a custom resource while a restarted
# API server has not registered its CRDs yet (seen in tests/e2e/test_control_plane_faults_e2e.py: the operator
# stopped following ModelServers after the outage). The operator starts it again instead; a fresh start lists
# everything, so nothing that changed meanwhile is missed.
RESTART_BACKOFF_S = (1.0, 30.0)  # first delay, doubling to this cap; back to the first after a minute of running


def serve_until_stopped(serve_once, stop: threading.Event, backoff: tuple[float, float] = RESTART_BACKOFF_S) -> int:
    """Call serve_once() until `stop` is set, waiting a growing delay after each run that ended on its own (or
    raised); returns how many times it started again."""
    log = logging.getLogger("kvgate.operator")
    first, cap = backoff
    delay, restarts = first, 0
    while not stop.is_set():
        started = time.monotonic()
        try:
            serve_once()
        except Exception:  # noqa: BLE001 - logged, then started again like any other end
            log.exception("the operator's reactor failed")
        if stop.is_set():
            break
        if restarts and time.monotonic() - started < 60:
            delay = min(delay * 2, cap)
        else:
            delay = first
        restarts += 1
        log.error("the operator's watches stopped on their own; starting them again in %.0f s (restart %d)",
                  delay, restarts)
        stop.wait(delay)
    return restarts
