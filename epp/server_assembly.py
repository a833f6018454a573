"""How `kvgate epp` puts the Endpoint Picker together from its flags and its EndpointPickerConfig: each part built
whole (datastore, datalayer, scheduler, flow control, director, peer sync, the ext-proc and health gRPC servers,
the metrics server, the pool's source, leader election), started in order, and stopped in order on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from dataclasses import dataclass
from functools import partial

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc_health.v1 import health_pb2_grpc
from prometheus_client import start_http_server

from kvgate.epp.admission import Admission
from kvgate.epp.datalayer import Datalayer
from kvgate.epp.datastore import (Datastore, EndpointsFile, load_manifests, parse_endpoints, parse_objectives,
                                  parse_rewrites)
from kvgate.epp.director import Director
from kvgate.common.tracing import Tracing, setup as setup_tracing
from kvgate.epp.extproc import ExtProcServicer
from kvgate.epp.metrics import EppMetrics
from kvgate.epp.readiness import Health, Readiness
from kvgate.epp.scheduling.config import load_config
from kvgate.epp.scheduling.framework import PluginContext, Scheduler
from kvgate.epp.shutdown import drain, hand_over

log = logging.getLogger("kvgate.epp")


async def serve(args: argparse.Namespace, stop: asyncio.Event, peer_key=None) -> None:
    """Run the EPP until `stop` is set, then stop it: with leader election the leader hands the Lease over, then
    the ext-proc server drains. `peer_key`: the pool's peer sync key (main.peer_sync_key), None to sync in clear."""
    epp = await assemble(args, peer_key)
    await epp.start()
    readiness = Readiness(epp.director, epp.datastore, epp.health, leading=not args.ha_enable_leader_election,
                          on_serving=epp.director.metrics.serving.set)
    elector = None
    if args.ha_enable_leader_election:  # a candidate once it can route (routable): a cold replica never leads
        elector = start_elector(args, readiness.set_leading, readiness.routable.is_set)
    try:
        await readiness.run(stop, poll=epp.pool.poll)
    finally:
        if elector is not None:
            await hand_over(elector, was_leading=readiness.serving)
        await epp.stop()


async def assemble(args: argparse.Namespace, peer_key) -> Epp:
    """Every part of the EPP built, the scheduler's plugins, peer sync and the metrics server already running;
    nothing that routes or answers the gateway started yet (Epp.start)."""
    config = load_config(args.config_file, args.config_text)
    datastore = Datastore()
    datalayer = build_datalayer(args, config.saturation)
    scheduler = start_scheduler(args, config.scheduler)
    metrics = EppMetrics()
    director = build_director(args, config, datastore, datalayer, scheduler, metrics, peer_key)
    metrics.watch(director)
    peer_pods = start_peer_sync(args, director, scheduler, metrics)
    datastore.listeners.append(PoolChanges(datalayer, scheduler, metrics))
    health = Health()
    await health.start()
    tracing = setup_tracing("kvgate-epp", getattr(args, "otlp_traces_endpoint", None))
    extproc = ExtProcServicer(director, metrics, config.report_served_endpoint, args.max_request_body_bytes,
                              tracer=tracing.tracer if tracing is not None else None)
    extproc_server = build_extproc_server(args, extproc)
    health_server = build_health_server(args, health)
    metrics_http, _ = start_http_server(args.metrics_port, addr=args.grpc_host, registry=metrics.registry)
    return Epp(args, datastore=datastore, datalayer=datalayer, scheduler=scheduler, director=director,
               extproc=extproc, health=health, extproc_server=extproc_server, health_server=health_server,
               metrics_http=metrics_http, pool=PoolSource(args, datastore), tracing=tracing, peer_pods=peer_pods)


@dataclass
class Epp:
    """The assembled EPP: the parts that start and stop with it."""
    args: argparse.Namespace
    datastore: Datastore
    datalayer: Datalayer
    scheduler: Scheduler
    director: Director
    extproc: ExtProcServicer
    health: Health
    extproc_server: grpc.aio.Server
    health_server: grpc.aio.Server
    metrics_http: object  # prometheus_client's HTTP server
    pool: PoolSource
    tracing: Tracing | None = None  # OpenTelemetry (kvgate.common.tracing): None unless an OTLP endpoint is set
    peer_pods: object | None = None  # the peers' pod watch (epp/peer_discovery.py), with --peer-sync-discover-pods

    async def start(self) -> None:
        """Scrapes, the gRPC servers, and the pool's endpoints, in that order."""
        args = self.args
        await self.datalayer.start()
        await self.extproc_server.start()
        await self.health_server.start()
        self.pool.start()
        log.info("EPP listening: ext-proc %s:%d, health %d, metrics %d", args.grpc_host, args.grpc_port,
                 args.grpc_health_port, args.metrics_port)

    async def stop(self) -> None:
        """The drain (shutdown.drain), then every part stopped."""
        await drain(self.extproc_server, self.extproc, self.health, self.args.shutdown_timeout,
                    self.args.drain_health == "not-serving")
        self.pool.stop()
        await self.health_server.stop(grace=0)
        await self.datalayer.stop()
        if self.director.flow is not None:
            self.director.flow.close()
        if self.peer_pods is not None:
            self.peer_pods.stop()
        if self.director.peers is not None:
            self.director.peers.close()
        self.scheduler.stop()
        self.metrics_http.shutdown()
        if self.tracing is not None:
            self.tracing.shutdown()  # the spans still queued go out (bounded by the export timeout)


def build_datalayer(args: argparse.Namespace, saturation) -> Datalayer:
    """The engines' metrics scrapes: the config's saturationDetector staleness threshold, else the flag's."""
    return Datalayer(interval=args.refresh_metrics_interval, timeout=1.0, max_bytes=args.metrics_max_bytes,
                     staleness=saturation.metrics_staleness_threshold or args.metrics_staleness_threshold)


def start_scheduler(args: argparse.Namespace, scheduler_config) -> Scheduler:
    """The config's plugins and profiles, started with the command line's options (a bad --tokenizer fails here)."""
    scheduler = Scheduler(scheduler_config)
    scheduler.start(plugin_context(args, asyncio.get_running_loop().call_soon_threadsafe))
    if scheduler.plugins_of_type("precise-prefix-cache-scorer") and args.kv_events_port is None \
            and not args.kv_events_endpoint:
        log.info("precise-prefix-cache-scorer: no --kv-events-port; only pods annotated kvgate.dev/kv-events-port "
                 "publish events to it")
    return scheduler


def plugin_context(args: argparse.Namespace, deliver=None) -> PluginContext:
    """The runtime options plugins take from the command line (Scheduler.start hands it to each)."""
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


def build_admission(args: argparse.Namespace, saturation) -> Admission:
    """The saturation detector: the --saturation-* flags where given, else the config's saturationDetector."""
    return Admission(
        queue_depth_threshold=args.saturation_queue_depth if args.saturation_queue_depth is not None
        else saturation.queue_depth_threshold,
        kv_cache_threshold=args.saturation_kv_cache if args.saturation_kv_cache is not None
        else saturation.kv_cache_util_threshold)


def build_director(args: argparse.Namespace, config, datastore: Datastore, datalayer: Datalayer,
                   scheduler: Scheduler, metrics: EppMetrics, peer_key) -> Director:
    """The director, with flow control when the config's featureGates name flowControl and peer sync with
    --peer-sync-bind (not started yet: start_peer_sync)."""
    admission = build_admission(args, config.saturation)
    flow = None
    if config.flow_control.enabled:
        flow = flow_controller(config.flow_control, admission, datalayer, metrics)
    peers = None
    if args.peer_sync_bind:
        from kvgate.epp.peer_sync import PeerSync

        peers = partial(PeerSync, bind=args.peer_sync_bind, peers=args.peer_sync_peer, key=peer_key)
    return Director(datastore, datalayer, scheduler, admission, metrics, trust_pool_readiness=bool(args.pool_name),
                    flow=flow, peers=peers)


def flow_controller(flow, admission: Admission, datalayer: Datalayer, metrics: EppMetrics):
    """Flow control's builder, which the director calls with its dispatch_room: requests wait in the controller
    while the pool is saturated, and each scrape round wakes it."""
    from kvgate.epp.flow_control import FlowController

    def build(dispatch_room):
        controller = FlowController(flow, dispatch_room, observe=metrics.observe_flow)
        datalayer.round_listeners.append(controller.wake)
        log.info("flow control on: requests wait while the pool is saturated (queue depth %d, KV %.2f), at most "
                 "%d requests / %d bytes, TTL %g s, %d configured priority band(s)", admission.queue_depth_threshold,
                 admission.kv_cache_threshold, flow.max_requests, flow.max_bytes, flow.default_ttl_s, len(flow.bands))
        return controller
    return build


def start_peer_sync(args: argparse.Namespace, director: Director, scheduler: Scheduler, metrics: EppMetrics):
    """Peer sync's sockets bound and its metrics exported, when the director has peer sync; with
    --peer-sync-discover-pods the peers' pod watch, started and returned. A bind that fails stops the scheduler's
    plugins and ends the process with one line."""
    if director.peers is None:
        return None
    import zmq

    from kvgate.epp.metrics import PeerSyncCollector

    try:
        director.peers.start()
    except zmq.ZMQError as exc:
        scheduler.stop()
        raise SystemExit(f"kvgate epp: --peer-sync-bind {args.peer_sync_bind}: {exc}") from exc
    metrics.registry.register(PeerSyncCollector(director.peers))
    if not getattr(args, "peer_sync_discover_pods", None):
        return None
    from kvgate.epp.peer_discovery import PeerPods

    loop, peers = asyncio.get_running_loop(), director.peers
    pods = PeerPods(args.pool_namespace, args.peer_sync_discover_pods, int(args.peer_sync_bind.rsplit(":", 1)[1]),
                    lambda addresses: loop.call_soon_threadsafe(peers.set_peers, addresses))
    pods.start()
    return pods


class PoolChanges:
    """The datastore's listener: a new endpoint list goes to the datalayer and the scheduler (endpoints that left
    removed from its plugins), on the event loop — the Kubernetes watcher calls from its thread."""

    def __init__(self, datalayer: Datalayer, scheduler: Scheduler, metrics: EppMetrics) -> None:
        self.datalayer, self.scheduler, self.metrics = datalayer, scheduler, metrics
        self._loop = asyncio.get_running_loop()
        self._known: set[str] = set()

    def __call__(self, endpoints) -> None:
        self._loop.call_soon_threadsafe(self._apply, endpoints)

    def _apply(self, endpoints) -> None:
        self.datalayer.set_endpoints(endpoints)
        current = {e.address for e in endpoints}
        for gone in self._known - current:
            self.scheduler.remove_endpoint(gone)
        self.scheduler.set_endpoints(endpoints)
        self._known = current
        self.metrics.gauges.publish(force=True)  # the exporter shows a pool change at once, not a round later
        log.info("pool endpoints: %s", ", ".join(sorted(current)) or "(none)")


def build_extproc_server(args: argparse.Namespace, extproc: ExtProcServicer) -> grpc.aio.Server:
    server = grpc.aio.server()
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(extproc, server)
    server.add_insecure_port(f"{args.grpc_host}:{args.grpc_port}")
    return server


def build_health_server(args: argparse.Namespace, health: Health) -> grpc.aio.Server:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
    server.add_insecure_port(f"{args.grpc_host}:{args.grpc_health_port}")
    return server


class PoolSource:
    """Where the pool's endpoints come from: the InferencePool's Ready pods (Kubernetes mode, a watcher thread),
    else --endpoints-file (re-read at each `poll`) or --endpoints, with --manifests' objectives and rewrites."""

    def __init__(self, args: argparse.Namespace, datastore: Datastore) -> None:
        self.args, self.datastore = args, datastore
        self.watcher = None
        self.endpoints_file: EndpointsFile | None = None

    def start(self) -> None:
        args = self.args
        if args.pool_name:
            from kvgate.epp.k8s_watch import PoolWatcher

            self.watcher = PoolWatcher(self.datastore, args.pool_name, args.pool_namespace)
            self.watcher.start()
            return
        if args.manifests:
            docs = load_manifests(args.manifests)
            self.datastore.set_policies(parse_objectives(docs), parse_rewrites(docs))
        if args.endpoints_file:
            self.endpoints_file = EndpointsFile(args.endpoints_file, self.datastore)
            self.endpoints_file.poll()
        else:
            self.datastore.set_endpoints(parse_endpoints(args.endpoints or ""))

    def poll(self) -> None:
        if self.endpoints_file is not None:
            self.endpoints_file.poll()

    def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()


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
