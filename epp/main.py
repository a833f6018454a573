"""`kvgate epp`: the Endpoint Picker process (ext-proc gRPC, health, metrics, datastore, datalayer)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import threading
from functools import partial

from kvgate.epp.datalayer.http_client import DEFAULT_MAX_BYTES as DEFAULT_METRICS_PAGE_BYTES
from kvgate.epp.leader import (DEFAULT_LEASE_DURATION_S, DEFAULT_RENEW_DEADLINE_S, DEFAULT_RETRY_PERIOD_S,
                               MAX_LEASE_DURATION_S)

log = logging.getLogger("kvgate.epp")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
# Upstream's EPP reports its readiness under this gRPC health service name (its manifests probe it).
UPSTREAM_HEALTH_SERVICE = "inference-extension"
READINESS_SERVICES = ("readiness", EXT_PROC_SERVICE, UPSTREAM_HEALTH_SERVICE, "")


def duration_flag(text: str) -> float:
    """A flag's duration: '50ms', '2s', '1m', '0.5' (seconds) -> seconds, 0 allowed (the config file's Go-style
    durations are scheduling.config.parse_duration, positive only)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m)?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 50ms, 2s)")
    return float(m.group(1)) * {"ms": 0.001, "s": 1.0, "m": 60.0, None: 1.0}[m.group(2)]


def index_bytes(text: str) -> int:
    from kvgate.epp.prefix.approx_index import MIN_INDEX_BYTES

    value = int(text)
    if value < MIN_INDEX_BYTES:
        raise argparse.ArgumentTypeError(f"must be at least {MIN_INDEX_BYTES} bytes, got {value}")
    return value


def metrics_page_bytes(text: str) -> int:
    """--metrics-max-bytes: a size in bytes (4194304, 4MiB), from 64 KiB to 256 MiB."""
    from kvgate.common.sizes import parse_bytes

    value = parse_bytes(text)
    if not MIN_METRICS_PAGE_BYTES <= value <= MAX_METRICS_PAGE_BYTES:
        raise argparse.ArgumentTypeError(f"must be from {MIN_METRICS_PAGE_BYTES} to {MAX_METRICS_PAGE_BYTES} bytes, "
                                         f"got {value}")
    return value


MIN_METRICS_PAGE_BYTES, MAX_METRICS_PAGE_BYTES = 64 << 10, 256 << 20


def port_number(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}")
    return int(text)


def tcp_endpoint(text: str) -> str:
    """--peer-sync-bind / --peer-sync-peer: a ZeroMQ tcp://HOST:PORT, checked as --kv-events-endpoint's sockets."""
    from kvgate.epp.kv_events.sources import is_tcp_socket

    if not is_tcp_socket(text):
        raise argparse.ArgumentTypeError(f"expected tcp://HOST:PORT, got {text!r}")
    return text


def kv_events_endpoint(text: str) -> tuple[str, object]:
    """--kv-events-endpoint ENDPOINT=PUB[,REPLAY] → (endpoint address, its EventSource)."""
    from kvgate.epp.kv_events.sources import parse_event_endpoint

    try:
        source = parse_event_endpoint(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return source.address, source


# Readiness waits for an endpoint it can route to (a first good scrape), at most this long after the pool's
# endpoints are known: a restarted EPP is not sent traffic it would answer 503, and a pool whose servers export
# no metrics (Kubernetes mode routes to their Ready pods) still gets an EPP.
READY_WITHOUT_SCRAPE_S = 2.0
# On SIGTERM the streams in flight get this long to finish (a rollout's old pod lingers for them; the operator's
# terminationGracePeriodSeconds covers it): long generations finish, a stuck stream cannot hold the pod forever.
DEFAULT_SHUTDOWN_TIMEOUT_S = 60.0
# The lame-duck phase of a drain (see drain()): Envoy's gRPC health check drops a NOT_SERVING EPP at its next
# check (1 s apart; only network failures wait for the unhealthy threshold of 3), a Service's endpoints take a
# moment to drop the pod. (The operator's EPP pods also sleep 5 s in preStop, answering SERVING, before SIGTERM.)
LAME_DUCK_QUIET_S = 1.0
# Behind a Service the gateway's connection moves to the new pod only on GOAWAY: the lame duck ends after this.
LAME_DUCK_MAX_S = 5.0
# After a successor took the Lease: Envoy's EPP health check runs every second (common/envoy_config.py), so within
# this it has seen the successor SERVING; only then does the old leader turn NOT_SERVING and drain.
HANDOVER_GRACE_S = 1.5


def can_route(director, datastore, seconds_since_sync: float) -> bool:
    """Whether the EPP may report ready: an empty pool (503 until pods come), an available endpoint, or the bound —
    which in standalone mode (no Ready pods to fall back on) also waits for every endpoint's first scrape to
    end: on a loaded machine a first scrape can take longer than the bound, and an EPP that turned ready before
    it would answer 503 for a pool that is fine."""
    if not datastore.endpoints or any(s.available for s in director.states()):
        return True
    if seconds_since_sync < READY_WITHOUT_SCRAPE_S:
        return False
    return director.trust_pool_readiness or director.datalayer.every_endpoint_scraped_once()


def add_epp_parser(sub) -> None:
    p = sub.add_parser("epp", help="run the Endpoint Picker (Envoy ext-proc server)")
    mode = p.add_argument_group("pool (Kubernetes mode or standalone)")
    mode.add_argument("--pool-name", help="InferencePool to serve (Kubernetes mode)")
    mode.add_argument("--pool-namespace", default="default")
    mode.add_argument("--endpoints", help="standalone: ip:port,ip:port,... of the engines")
    mode.add_argument("--endpoints-file",
                      help="standalone: a file of ip:port entries (one or more a line, '#' comments), re-read "
                           "every 0.5 s; a change is used once the file was left alone for 0.25 s (or reads the "
                           "same twice) and did not change while read, so in-place rewrites and atomic renames "
                           "both work; bad lines are logged and skipped, and an unreadable file keeps the last "
                           "good set")
    mode.add_argument("--manifests", help="standalone: YAML with InferenceObjective / InferenceModelRewrite objects")
    p.add_argument("--grpc-host", default="127.0.0.1", help="address to listen on (0.0.0.0 in a pod)")
    p.add_argument("--grpc-port", type=int, default=9002)
    p.add_argument("--grpc-health-port", type=int, default=9003)
    p.add_argument("--metrics-port", type=int, default=9090)
    p.add_argument("--config-file", help="EndpointPickerConfig YAML (plugins and scheduling profiles); default: "
                                         "upstream's (queue 2, kv-cache 2, prefix 3, max-score picker, one endpoint)")
    p.add_argument("--config-text", help="the EndpointPickerConfig YAML itself, instead of --config-file")
    p.add_argument("--max-request-body-bytes", type=int, default=16 * 1024 * 1024,
                   help="larger request bodies are answered 413 without being buffered (default 16 MiB)")
    p.add_argument("--shutdown-timeout", type=duration_flag, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                   help="on SIGTERM, seconds the streams in flight may take to finish before they are cut "
                        "(their response bodies pass through the EPP); new streams go elsewhere at once")
    p.add_argument("--drain-health", choices=("not-serving", "serving"), default="not-serving",
                   help="what the health service answers while draining: not-serving (default) for gateways that "
                        "address this EPP directly; serving behind a Service, whose one address must stay healthy")
    ha = p.add_argument_group("high availability (active-passive)")
    ha.add_argument("--ha-enable-leader-election", action="store_true",
                    help="run as one of several replicas: a coordination.k8s.io Lease (upstream's name, in the "
                         "pool's namespace; --ha-lease-file standalone) elects the one that reports ready; the "
                         "others keep watching the pool and scraping it, so a failover finds a warm EPP, and answer "
                         "NOT_SERVING until they lead")
    ha.add_argument("--ha-lease-file", metavar="PATH",
                    help="standalone mode, replicas on one machine (a local stack as kvgate up runs, "
                         "benchmarks): elect over a lease record in this file (created 0600; its directory must "
                         "exist; flock-guarded) instead of a Kubernetes Lease, which Kubernetes mode always uses")
    ha.add_argument("--ha-lease-duration", type=duration_flag, default=DEFAULT_LEASE_DURATION_S,
                    help="how long a leader that stopped renewing keeps the Lease (default "
                         f"{DEFAULT_LEASE_DURATION_S:g} s, at most {MAX_LEASE_DURATION_S:g} s; a leader that stops on "
                         "SIGTERM releases it at once)")
    ha.add_argument("--ha-renew-deadline", type=duration_flag, default=DEFAULT_RENEW_DEADLINE_S,
                    help="a leader that could not renew for this long steps down (default "
                         f"{DEFAULT_RENEW_DEADLINE_S:g} s)")
    ha.add_argument("--ha-retry-period", type=duration_flag, default=DEFAULT_RETRY_PERIOD_S,
                    help=f"how often candidates try and the leader renews (default {DEFAULT_RETRY_PERIOD_S:g} s)")
    peers = p.add_argument_group("active-active replicas (epp/peer_sync.py; off unless --peer-sync-bind is given)")
    peers.add_argument("--peer-sync-bind", type=tcp_endpoint, metavar="tcp://HOST:PORT",
                       help="publish this replica's picks here (a ZeroMQ PUB socket) for the other replicas serving "
                            "the same pool, so that all decide on every replica's in-flight requests, held prefix "
                            "blocks and prefix-group placements; listen on the address the peers reach, no wider")
    peers.add_argument("--peer-sync-peer", type=tcp_endpoint, action="append", default=[], metavar="tcp://HOST:PORT",
                       help="another replica's --peer-sync-bind (repeat per replica)")
    peers.add_argument("--peer-sync-key-file", metavar="PATH",
                       help="the pool's CURVE key, the same file on every replica (a ZeroMQ certificate with "
                            "public-key and secret-key, as `kvgate peer-sync-keygen PATH` writes; in Kubernetes a "
                            "Secret mounted as a file): only holders of it may subscribe to this replica's picks or "
                            "publish picks it applies, and every message is encrypted; needed with "
                            "--peer-sync-bind unless --peer-sync-insecure")
    peers.add_argument("--peer-sync-insecure", action="store_true",
                       help="sync without a key (plain ZeroMQ): anyone who reaches --peer-sync-bind reads every "
                            "pick, prompt block hashes included, and a process at a --peer-sync-peer address can "
                            "feed this replica picks; only where nothing else reaches the sockets")
    p.add_argument("--refresh-metrics-interval", type=duration_flag, default=0.05)
    p.add_argument("--metrics-staleness-threshold", type=duration_flag, default=2.0)
    p.add_argument("--metrics-max-bytes", type=metrics_page_bytes, default=DEFAULT_METRICS_PAGE_BYTES,
                   metavar="BYTES",
                   help="an engine's /metrics body larger than this (or, chunked, twice this on the wire) fails its "
                        "scrape (default 4MiB; a vLLM page with its histograms and LoRA info is a few hundred KiB)")
    p.add_argument("--saturation-queue-depth", type=int, default=None,
                   help="an endpoint with this many waiting requests counts as saturated "
                        "(default: the config file's saturationDetector, else 5)")
    p.add_argument("--saturation-kv-cache", type=float, default=None,
                   help="an endpoint with this KV-cache usage counts as saturated (default: config, else 0.8)")
    p.add_argument("--prefix-index-max-bytes", type=index_bytes, default=None,
                   help="memory budget of the prefix-cache scorer's index over all endpoints; least recently used "
                        "blocks go first past it (default: the plugin's indexMaxBytes, else 256 MiB); also the "
                        "precise-prefix-cache-scorer's, past which new blocks are not indexed")
    events = p.add_argument_group("precise prefix routing (used only by a config with precise-prefix-cache-scorer)")
    events.add_argument("--tokenizer", help="folder with the pool model's tokenizer files (the model folder): the "
                                            "EPP tokenizes prompts as the engines do; default: the scorer's "
                                            "tokenizer parameter, else the sim backend's byte tokenizer")
    events.add_argument("--kv-events-port", type=port_number, default=None,
                        help="each endpoint publishes KV-cache events on tcp://<endpoint ip>:PORT (its engine's "
                             "--kv-events-config endpoint); a pod's kvgate.dev/kv-events-port annotation overrides "
                             "it; default: none (only annotated pods)")
    events.add_argument("--kv-events-replay-port", type=port_number, default=None,
                        help="the engines' replay (ROUTER) port, asked for missed batches; default: none (a gap "
                             "drops that endpoint's blocks until new events rebuild them)")
    events.add_argument("--kv-events-topic", default="", help="topic to subscribe to (default: every topic)")
    events.add_argument("--kv-events-endpoint", action="append", default=[], type=kv_events_endpoint,
                        metavar="ENDPOINT=PUB[,REPLAY]",
                        help="where one endpoint publishes, when it is not <endpoint ip>:--kv-events-port (engines "
                             "sharing a host, each binding its own sockets), e.g. "
                             "127.0.0.2:8000=tcp://[::1]:5557,tcp://[::1]:5558; repeat per endpoint")
    # Upstream EPP flags that change nothing here, accepted so that upstream manifests (e.g. the conformance
    # suite's EPP Deployments) run this EPP unchanged: logging format/level are ours (--log-level).
    compat = p.add_argument_group("accepted for compatibility with the upstream EPP (no effect)")
    compat.add_argument("--zap-encoder", choices=("json", "console"), help=argparse.SUPPRESS)
    compat.add_argument("--zap-log-level", help=argparse.SUPPRESS)
    compat.add_argument("--v", "-v", dest="upstream_verbosity", help=argparse.SUPPRESS)
    p.set_defaults(func=run_epp)


def add_keygen_parser(sub) -> None:
    p = sub.add_parser("peer-sync-keygen",
                       help="write a new pool key for active-active EPP peer sync (kvgate epp --peer-sync-key-file)")
    p.add_argument("path", metavar="PATH",
                   help="the certificate file to write (ZeroMQ's .key_secret format, mode 0600; an existing file is "
                        "never replaced): give it to every EPP replica of one pool, e.g. as a Kubernetes Secret "
                        "mounted as a file")
    p.set_defaults(func=run_keygen)


def run_keygen(args: argparse.Namespace) -> int:
    from kvgate.epp.peer_sync_keys import write_pool_key

    key = write_pool_key(args.path)  # a PeerSyncKeyError is kvgate's one-line exit 2
    print(f"wrote {args.path} (public key {key.public.decode()})")
    return 0


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from prometheus_client import start_http_server

    from kvgate.epp.admission import Admission
    from kvgate.epp.datalayer import Datalayer
    from kvgate.epp.datastore import (Datastore, EndpointsFile, load_manifests, parse_endpoints, parse_objectives,
                                      parse_rewrites)
    from kvgate.epp.director import Director
    from kvgate.epp.extproc import ExtProcServicer
    from kvgate.epp.metrics import EppMetrics
    from kvgate.epp.scheduling.config import load_config
    from kvgate.epp.scheduling.framework import Scheduler

    config = load_config(args.config_file, args.config_text)
    saturation = config.saturation
    datastore = Datastore()
    datalayer = Datalayer(interval=args.refresh_metrics_interval, timeout=1.0, max_bytes=args.metrics_max_bytes,
                          staleness=saturation.metrics_staleness_threshold or args.metrics_staleness_threshold)
    scheduler = Scheduler(config.scheduler)
    loop = asyncio.get_running_loop()
    scheduler.start(plugin_context(args, loop.call_soon_threadsafe))  # a bad --tokenizer fails here, at start
    if scheduler.plugins_of_type("precise-prefix-cache-scorer") and args.kv_events_port is None \
            and not args.kv_events_endpoint:
        log.info("precise-prefix-cache-scorer: no --kv-events-port; only pods annotated kvgate.dev/kv-events-port "
                 "publish events to it")
    metrics = EppMetrics()
    admission = Admission(
        queue_depth_threshold=args.saturation_queue_depth if args.saturation_queue_depth is not None
        else saturation.queue_depth_threshold,
        kv_cache_threshold=args.saturation_kv_cache if args.saturation_kv_cache is not None
        else saturation.kv_cache_util_threshold)
    director = Director(datastore, datalayer, scheduler, admission, metrics,
                        trust_pool_readiness=bool(args.pool_name))
    flow = config.flow_control
    if flow.enabled:
        from kvgate.epp.flow_control import FlowController

        director.flow = FlowController(flow, director.dispatch_room, observe=metrics.observe_flow)
        datalayer.round_listeners.append(director.flow.wake)
        log.info("flow control on: requests wait while the pool is saturated (queue depth %d, KV %.2f), at most "
                 "%d requests / %d bytes, TTL %g s, %d configured priority band(s)", admission.queue_depth_threshold,
                 admission.kv_cache_threshold, flow.max_requests, flow.max_bytes, flow.default_ttl_s, len(flow.bands))
    metrics.watch(director)
    if args.peer_sync_bind:
        import zmq

        from kvgate.epp.metrics import PeerSyncCollector
        from kvgate.epp.peer_sync import PeerSync

        director.peers = PeerSync(director, args.peer_sync_bind, args.peer_sync_peer, key=args.peer_sync_key)
        try:
            director.peers.start()
        except zmq.ZMQError as exc:
            scheduler.stop()
            raise SystemExit(f"kvgate epp: --peer-sync-bind {args.peer_sync_bind}: {exc}") from exc
        metrics.registry.register(PeerSyncCollector(director.peers))

    known: set[str] = set()

    def on_endpoints(endpoints) -> None:  # may be called from the watcher thread
        def apply():
            datalayer.set_endpoints(endpoints)
            current = {e.address for e in endpoints}
            for gone in known - current:
                scheduler.remove_endpoint(gone)
            scheduler.set_endpoints(endpoints)
            known.clear()
            known.update(current)
            metrics.gauges.publish(force=True)  # the exporter shows a pool change at once, not a round later
            log.info("pool endpoints: %s", ", ".join(sorted(current)) or "(none)")
        loop.call_soon_threadsafe(apply)

    datastore.listeners.append(on_endpoints)
    health_servicer = health.aio.HealthServicer()
    await health_servicer.set("liveness", health_pb2.HealthCheckResponse.SERVING)
    for name in READINESS_SERVICES:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    server = grpc.aio.server()
    extproc = ExtProcServicer(director, metrics, config.report_served_endpoint, args.max_request_body_bytes)
    pb_grpc.add_ExternalProcessorServicer_to_server(extproc, server)
    server.add_insecure_port(f"{args.grpc_host}:{args.grpc_port}")
    health_server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)
    health_server.add_insecure_port(f"{args.grpc_host}:{args.grpc_health_port}")
    metrics_http, metrics_thread = start_http_server(args.metrics_port, addr=args.grpc_host, registry=metrics.registry)

    await datalayer.start()
    await server.start()
    await health_server.start()
    watcher = None
    endpoints_file = None
    if args.pool_name:
        from kvgate.epp.k8s_watch import PoolWatcher

        watcher = PoolWatcher(datastore, args.pool_name, args.pool_namespace)
        watcher.start()
    else:
        if args.manifests:
            docs = load_manifests(args.manifests)
            datastore.set_policies(parse_objectives(docs), parse_rewrites(docs))
        if args.endpoints_file:
            endpoints_file = EndpointsFile(args.endpoints_file, datastore)
            endpoints_file.poll()
        else:
            datastore.set_endpoints(parse_endpoints(args.endpoints or ""))
    log.info("EPP listening: ext-proc %s:%d, health %d, metrics %d", args.grpc_host, args.grpc_port,
             args.grpc_health_port, args.metrics_port)
    # Readiness: SERVING once the EPP can route and, with leader election, while it leads (the protocol's rule
    # for an active-passive EPP: followers are live but not ready). A leadership change wakes the loop at once.
    elector, leading, wake, routable = None, not args.ha_enable_leader_election, asyncio.Event(), threading.Event()
    if args.ha_enable_leader_election:  # a candidate once it can route (routable): a cold replica never leads
        elector = start_elector(args, lambda now: loop.call_soon_threadsafe(set_leading, now), routable.is_set)

    def set_leading(now: bool) -> None:
        nonlocal leading
        leading = now
        wake.set()

    ready, synced_at, serving = False, None, False
    try:
        while not stop.is_set():
            if endpoints_file is not None:
                endpoints_file.poll()
            if datastore.synced and not ready:
                synced_at = synced_at or loop.time()
                if can_route(director, datastore, loop.time() - synced_at):
                    ready = True
                    routable.set()
                    log.info("ready %.2f s after the pool's endpoints were known", loop.time() - synced_at)
            if (ready and leading) != serving:
                serving = ready and leading
                status = health_pb2.HealthCheckResponse.NOT_SERVING
                if serving:
                    status = health_pb2.HealthCheckResponse.SERVING
                for name in READINESS_SERVICES:
                    await health_servicer.set(name, status)
            wake.clear()
            try:
                await asyncio.wait_for(_first(stop.wait(), wake.wait()), timeout=0.5 if ready else 0.05)
            except asyncio.TimeoutError:
                pass
    finally:
        if elector is not None:
            await hand_over(elector, loop, was_leading=serving)
        await drain(server, extproc, health_servicer, args.shutdown_timeout, args.drain_health == "not-serving")
        if watcher is not None:
            watcher.stop()
        await health_server.stop(grace=0)
        await datalayer.stop()
        if director.flow is not None:
            director.flow.close()
        if director.peers is not None:
            director.peers.close()
        scheduler.stop()
        metrics_http.shutdown()


async def hand_over(elector, loop, was_leading: bool) -> None:
    """On SIGTERM with leader election: release the Lease, and if this EPP was the ready leader, keep serving
    until a follower holds the Lease and Envoy's health check (1 s apart) has had time to find it ready: with
    healthy_panic_threshold 0 (kvgate's config then) Envoy answered 500 while no EPP was ready (measured on the rig:
    107 of 226 streamed requests in the 1.2 s between the leader's NOT_SERVING and the follower's SERVING). Bounded:
    two retry periods and a second for a successor, then the drain goes on regardless."""
    try:
        await loop.run_in_executor(None, elector.stop)
        if not was_leading:
            return
        successor = await loop.run_in_executor(None, elector.wait_for_successor,
                                               2 * elector.retry_period + 1.0)
    except Exception:  # the API server unreachable (a urllib3 error, not an ApiException): the drain still runs
        log.exception("leader election: the hand-over failed; draining anyway")
        return
    if successor is None:
        log.warning("leader election: no follower took the Lease; draining anyway")
        return
    log.info("leader election: %s leads now; serving %.1f s more while the gateways find it ready", successor,
             HANDOVER_GRACE_S)
    await asyncio.sleep(HANDOVER_GRACE_S)


async def _first(*aws) -> None:
    """Wait for the first of these awaitables; cancel the rest."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


def start_elector(args: argparse.Namespace, on_change, can_lead):
    """Leader election (epp/leader.py), started: over the pool's Lease in Kubernetes mode, over `--ha-lease-file`
    (epp/file_lease.py) standalone."""
    from kvgate.epp.leader import LeaseElector, default_identity, lease_name

    if args.ha_lease_file:
        from kvgate.epp.file_lease import FileLeaseApi

        api, namespace, name = FileLeaseApi(args.ha_lease_file), "standalone", lease_name("standalone", "epp")
        identity, where = f"{default_identity()}-pid{os.getpid()}", f"file {args.ha_lease_file}"
    else:
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        api, namespace = client.CoordinationV1Api(), args.pool_namespace
        name, identity = lease_name(args.pool_namespace, args.pool_name), default_identity()
        where = f"Lease {namespace}/{name}"
    elector = LeaseElector(api, name, namespace, identity, on_change,
                           lease_duration=args.ha_lease_duration, renew_deadline=args.ha_renew_deadline,
                           retry_period=args.ha_retry_period, can_lead=can_lead)
    log.info("leader election on: %s as %s (lease %g s, renew deadline %g s, retry %g s)", where,
             elector.identity, args.ha_lease_duration, args.ha_renew_deadline, args.ha_retry_period)
    elector.start()
    return elector


def plugin_context(args: argparse.Namespace, deliver=None):
    """The runtime options plugins take from the command line (Scheduler.start hands it to each)."""
    from kvgate.epp.scheduling.framework import PluginContext

    return PluginContext(deliver=deliver, tokenizer=args.tokenizer, prefix_index_max_bytes=args.prefix_index_max_bytes,
                         kv_event_sources=partial(kv_event_sources, args))


def kv_event_sources(args: argparse.Namespace, endpoints) -> list:
    """Each endpoint's KV-event source: `--kv-events-endpoint` where given, else its pod annotations and the
    `--kv-events-*` defaults (None: it publishes none)."""
    from kvgate.epp.kv_events.sources import event_source

    explicit = dict(args.kv_events_endpoint)
    return [s for s in (explicit[e.address].with_topic(args.kv_events_topic) if e.address in explicit else
                        event_source(e, args.kv_events_port, args.kv_events_replay_port, args.kv_events_topic)
                        for e in endpoints) if s is not None]


async def drain(server, extproc, health_servicer, shutdown_timeout: float, report_not_serving: bool = True) -> None:
    """SIGTERM: readiness turns NOT_SERVING at once (`--drain-health not-serving`, for a gateway that addresses
    this EPP itself: its health check takes it out and sends the next streams to another EPP or the failure mode;
    behind a Service, `serving`: the gateway's one host is the Service, whose health must not flip while a new
    pod serves), and the EPP goes on serving every stream, new ones too, while the gateway notices (or the pod
    leaves the Service's endpoints): until no stream has started for `LAME_DUCK_QUIET_S` — addressed directly,
    within `shutdown_timeout` (the gateway may not know another EPP yet); behind a Service, at most
    `LAME_DUCK_MAX_S`.
    Closing earlier would refuse streams Envoy has already routed here — and Envoy can fail open only before it
    has sent a body chunk, so those would be 500s even under FailOpen. Then grpc's stop sends GOAWAY (the
    gateway's next streams open a new connection: the new EPP pod, or its failure mode) and the streams in
    flight, whose response bodies pass through here, finish within `shutdown_timeout`; only those still
    running then are cut."""
    from grpc_health.v1 import health_pb2

    if report_not_serving:
        for name in READINESS_SERVICES:
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    loop = asyncio.get_running_loop()
    began = loop.time()
    # A gateway that addresses this EPP leaves it when its health check and its endpoint list say so; until its
    # list names another EPP it keeps sending here (one host, unhealthy: Envoy's panic routing), and a stream
    # refused here is a 500. So the lame duck lasts while streams keep coming, within the shutdown timeout. Behind
    # a Service, only GOAWAY moves the gateway's connection to the new pod: the lame duck lasts while the Service
    # drops this pod, at most LAME_DUCK_MAX_S.
    budget = shutdown_timeout if report_not_serving else min(LAME_DUCK_MAX_S, shutdown_timeout)
    while loop.time() - began < budget and loop.time() - max(extproc.last_started, began) < LAME_DUCK_QUIET_S:
        await asyncio.sleep(0.1)
    remaining = max(0.0, shutdown_timeout - (loop.time() - began))
    if extproc.active:
        log.info("draining: %d streams in flight, up to %.0f s", extproc.active, remaining)
    stopping = asyncio.create_task(server.stop(grace=remaining))  # GOAWAY now; cancels what runs at the end
    deadline = loop.time() + remaining
    while extproc.active and loop.time() < deadline - 0.05:
        await asyncio.sleep(0.05)
    cut = extproc.active
    await stopping
    if cut:
        log.warning("cut %d streams still running after %g s", cut, shutdown_timeout)


def peer_sync_key(args: argparse.Namespace):
    """The pool's key for peer sync (PoolKey), or None without sync or with `--peer-sync-insecure`; a missing or
    bad key file is a PeerSyncKeyError (kvgate's CLI: one line, exit 2)."""
    from kvgate.epp.peer_sync_keys import PeerSyncKeyError, load_pool_key

    if not args.peer_sync_bind:
        for flag, given in (("--peer-sync-key-file", args.peer_sync_key_file),
                            ("--peer-sync-insecure", args.peer_sync_insecure)):
            if given:
                raise PeerSyncKeyError(f"{flag} needs --peer-sync-bind")
        return None
    if args.peer_sync_key_file and args.peer_sync_insecure:
        raise PeerSyncKeyError("give --peer-sync-key-file or --peer-sync-insecure, not both")
    if args.peer_sync_insecure:
        return None
    if not args.peer_sync_key_file:
        raise PeerSyncKeyError("--peer-sync-bind needs --peer-sync-key-file PATH, the pool's key (kvgate "
                               "peer-sync-keygen PATH makes one), or --peer-sync-insecure to sync in clear "
                               "without authentication")
    return load_pool_key(args.peer_sync_key_file)


def run_epp(args: argparse.Namespace) -> int:
    from kvgate.epp.scheduling.config import ConfigError, load_config

    try:
        if args.config_file and args.config_text:
            raise ConfigError("give --config-file or --config-text, not both")
        load_config(args.config_file, args.config_text)  # fail fast, before any port is opened
    except ConfigError as exc:
        raise SystemExit(f"kvgate epp: {exc}") from exc
    if args.max_request_body_bytes <= 0:
        raise SystemExit("kvgate epp: --max-request-body-bytes must be positive")
    if args.tokenizer:
        from kvgate.common.errors import ModelLoadError
        from kvgate.epp.kv_events.tokenize import PromptTokenizer

        try:
            PromptTokenizer(args.tokenizer)
        except ModelLoadError as exc:
            raise SystemExit(f"kvgate epp: --tokenizer: {exc}") from exc
    if bool(args.pool_name) == bool(args.endpoints or args.endpoints_file):
        raise SystemExit("kvgate epp: give either --pool-name (Kubernetes mode) or --endpoints/--endpoints-file")
    if args.ha_lease_file and args.pool_name:
        raise SystemExit("kvgate epp: --ha-lease-file is for standalone replicas on one machine; in Kubernetes mode "
                         "(--pool-name) the Lease lives in the pool's namespace")
    if args.ha_lease_file and not args.ha_enable_leader_election:
        raise SystemExit("kvgate epp: --ha-lease-file needs --ha-enable-leader-election")
    if args.ha_enable_leader_election and not (args.pool_name or args.ha_lease_file):
        raise SystemExit("kvgate epp: --ha-enable-leader-election needs Kubernetes mode (--pool-name: the Lease "
                         "lives in the pool's namespace) or, for replicas on one machine, --ha-lease-file PATH")
    if args.ha_lease_file and not os.path.isdir(os.path.dirname(os.path.abspath(args.ha_lease_file))):
        raise SystemExit(f"kvgate epp: --ha-lease-file: no directory {os.path.dirname(args.ha_lease_file)!r}")
    if args.ha_enable_leader_election and not (
            0 < args.ha_retry_period < args.ha_renew_deadline < args.ha_lease_duration <= MAX_LEASE_DURATION_S):
        raise SystemExit("kvgate epp: leader election needs --ha-retry-period < --ha-renew-deadline < "
                         f"--ha-lease-duration <= {MAX_LEASE_DURATION_S:g}s (a longer lease is one the other "
                         "replicas take over as unusable)")
    if args.manifests:
        from kvgate.epp.datastore import load_manifests

        try:
            load_manifests(args.manifests)  # fail fast, as the config file does
        except (OSError, ValueError) as exc:
            raise SystemExit(f"kvgate epp: --manifests {args.manifests}: {getattr(exc, 'strerror', None) or exc}") \
                from exc
    if args.peer_sync_peer and not args.peer_sync_bind:
        raise SystemExit("kvgate epp: --peer-sync-peer needs --peer-sync-bind (peers sync both ways)")
    args.peer_sync_key = peer_sync_key(args)
    if args.endpoints:
        from kvgate.epp.datastore import parse_endpoints

        try:
            parse_endpoints(args.endpoints)
        except ValueError as exc:
            raise SystemExit(f"kvgate epp: {exc}") from exc

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(args, stop)

    asyncio.run(main())
    return 0
