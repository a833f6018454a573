"""`kvgate epp` and `kvgate peer-sync-keygen`: their flags, the checks made before any port opens, and the entry
that runs the Endpoint Picker (epp/server_assembly.py puts it together)."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal

from kvgate.epp.datalayer.http_client import DEFAULT_MAX_BYTES as DEFAULT_METRICS_PAGE_BYTES
from kvgate.epp.leader import (DEFAULT_LEASE_DURATION_S, DEFAULT_RENEW_DEADLINE_S, DEFAULT_RETRY_PERIOD_S,
                               MAX_LEASE_DURATION_S)
from kvgate.epp.shutdown import DEFAULT_SHUTDOWN_TIMEOUT_S

MIN_METRICS_PAGE_BYTES, MAX_METRICS_PAGE_BYTES = 64 << 10, 256 << 20


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


def pod_selector(text: str) -> str:
    from kvgate.epp.peer_discovery import check_selector

    try:
        return check_selector(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def kv_events_endpoint(text: str) -> tuple[str, object]:
    """--kv-events-endpoint ENDPOINT=PUB[,REPLAY] → (endpoint address, its EventSource)."""
    from kvgate.epp.kv_events.sources import parse_event_endpoint

    try:
        source = parse_event_endpoint(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return source.address, source


def add_epp_parser(sub) -> None:
    p = sub.add_parser("epp", help="run the Endpoint Picker (Envoy ext-proc server)")
    for add_flags in (add_pool_flags, add_listen_flags, add_request_flags, add_shutdown_flags,
                      add_leader_election_flags, add_peer_sync_flags, add_datalayer_flags, add_scheduling_flags,
                      add_precise_prefix_flags, add_tracing_flags, add_upstream_compat_flags):
        add_flags(p)
    p.set_defaults(func=run_epp)


def add_pool_flags(p) -> None:
    """Which pool: an InferencePool's pods (Kubernetes mode) or endpoints given standalone."""
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


def add_listen_flags(p) -> None:
    """The ext-proc, health and metrics servers' address and ports."""
    p.add_argument("--grpc-host", default="127.0.0.1", help="address to listen on (0.0.0.0 in a pod)")
    p.add_argument("--grpc-port", type=int, default=9002)
    p.add_argument("--grpc-health-port", type=int, default=9003)
    p.add_argument("--metrics-port", type=int, default=9090)


def add_request_flags(p) -> None:
    """What the EPP does with a request: the EndpointPickerConfig's plugins and profiles, the body limit."""
    p.add_argument("--config-file", help="EndpointPickerConfig YAML (plugins and scheduling profiles); default: "
                                         "upstream's (queue 2, kv-cache 2, prefix 3, max-score picker, one endpoint)")
    p.add_argument("--config-text", help="the EndpointPickerConfig YAML itself, instead of --config-file")
    p.add_argument("--max-request-body-bytes", type=int, default=16 * 1024 * 1024,
                   help="larger request bodies are answered 413 without being buffered (default 16 MiB)")


def add_tracing_flags(p) -> None:
    """OpenTelemetry tracing (epp/tracing.py): off unless an OTLP endpoint is given, here or by OTEL_* variables."""
    p.add_argument("--otlp-traces-endpoint", metavar="URL", default=None,
                   help="OTLP/gRPC collector for the EPP's request spans (http://HOST:4317); default: "
                        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT, else no tracing. The "
                        "sampler is OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG's (default parentbased_always_on)")


def add_shutdown_flags(p) -> None:
    """How the EPP drains on SIGTERM (shutdown.drain)."""
    p.add_argument("--shutdown-timeout", type=duration_flag, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                   help="on SIGTERM, seconds the streams in flight may take to finish before they are cut "
                        "(their response bodies pass through the EPP); new streams go elsewhere at once")
    p.add_argument("--drain-health", choices=("not-serving", "serving"), default="not-serving",
                   help="what the health service answers while draining: not-serving (default) for gateways that "
                        "address this EPP directly; serving behind a Service, whose one address must stay healthy")


def add_leader_election_flags(p) -> None:
    """Active-passive replicas: leader election over a Lease or a lease file."""
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


def add_peer_sync_flags(p) -> None:
    """Active-active replicas: each replica's picks shared with the others."""
    peers = p.add_argument_group("active-active replicas (epp/peer_sync.py; off unless --peer-sync-bind is given)")
    peers.add_argument("--peer-sync-bind", type=tcp_endpoint, metavar="tcp://HOST:PORT",
                       help="publish this replica's picks here (a ZeroMQ PUB socket) for the other replicas serving "
                            "the same pool, so that all decide on every replica's in-flight requests, held prefix "
                            "blocks and prefix-group placements; listen on the address the peers reach, no wider")
    peers.add_argument("--peer-sync-peer", type=tcp_endpoint, action="append", default=[], metavar="tcp://HOST:PORT",
                       help="another replica's --peer-sync-bind (repeat per replica)")
    peers.add_argument("--peer-sync-discover-pods", type=pod_selector, metavar="SELECTOR",
                       help="Kubernetes mode: the peers are the running pods of the pool's namespace with these labels "
                            "(k=v[,k=v...]: the EPP's own), at their pod IP and --peer-sync-bind's port, followed "
                            "by a watch (epp/peer_discovery.py); this pod ($HOSTNAME, $POD_IP) left out")
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


def add_datalayer_flags(p) -> None:
    """The engines' metrics scrapes."""
    p.add_argument("--refresh-metrics-interval", type=duration_flag, default=0.05)
    p.add_argument("--metrics-staleness-threshold", type=duration_flag, default=2.0)
    p.add_argument("--metrics-max-bytes", type=metrics_page_bytes, default=DEFAULT_METRICS_PAGE_BYTES,
                   metavar="BYTES",
                   help="an engine's /metrics body larger than this (or, chunked, twice this on the wire) fails its "
                        "scrape (default 4MiB; a vLLM page with its histograms and LoRA info is a few hundred KiB)")


def add_scheduling_flags(p) -> None:
    """The saturation detector's thresholds and the prefix index's budget, over the config's."""
    p.add_argument("--saturation-queue-depth", type=int, default=None,
                   help="an endpoint with this many waiting requests counts as saturated "
                        "(default: the config file's saturationDetector, else 5)")
    p.add_argument("--saturation-kv-cache", type=float, default=None,
                   help="an endpoint with this KV-cache usage counts as saturated (default: config, else 0.8)")
    p.add_argument("--prefix-index-max-bytes", type=index_bytes, default=None,
                   help="memory budget of the prefix-cache scorer's index over all endpoints; least recently used "
                        "blocks go first past it (default: the plugin's indexMaxBytes, else 256 MiB); also the "
                        "precise-prefix-cache-scorer's, past which new blocks are not indexed")


def add_precise_prefix_flags(p) -> None:
    """The precise prefix scorer's tokenizer and the engines' KV-cache event sockets."""
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


def add_upstream_compat_flags(p) -> None:
    """Upstream EPP flags that change nothing here, accepted so that upstream manifests (e.g. the conformance
    suite's EPP Deployments) run this EPP unchanged: logging format/level are ours (--log-level)."""
    compat = p.add_argument_group("accepted for compatibility with the upstream EPP (no effect)")
    compat.add_argument("--zap-encoder", choices=("json", "console"), help=argparse.SUPPRESS)
    compat.add_argument("--zap-log-level", help=argparse.SUPPRESS)
    compat.add_argument("--v", "-v", dest="upstream_verbosity", help=argparse.SUPPRESS)


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


def run_epp(args: argparse.Namespace) -> int:
    for check in (check_config_flags, check_pool_mode, check_leader_election_flags, check_manifests):
        check(args)
    peer_key = peer_sync_key(args)
    check_endpoints(args)
    from kvgate.epp.server_assembly import serve

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(args, stop, peer_key)

    asyncio.run(main())
    return 0


def check_config_flags(args: argparse.Namespace) -> None:
    """The EndpointPickerConfig loads, the body limit is positive and --tokenizer loads: fail fast, before any port
    is opened."""
    from kvgate.epp.scheduling.config import ConfigError, load_config

    try:
        if args.config_file and args.config_text:
            raise ConfigError("give --config-file or --config-text, not both")
        load_config(args.config_file, args.config_text)
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


def check_pool_mode(args: argparse.Namespace) -> None:
    if bool(args.pool_name) == bool(args.endpoints or args.endpoints_file):
        raise SystemExit("kvgate epp: give either --pool-name (Kubernetes mode) or --endpoints/--endpoints-file")


def check_leader_election_flags(args: argparse.Namespace) -> None:
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


def check_manifests(args: argparse.Namespace) -> None:
    """--manifests loads (fail fast, as the config file does)."""
    if not args.manifests:
        return
    from kvgate.epp.datastore import load_manifests

    try:
        load_manifests(args.manifests)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"kvgate epp: --manifests {args.manifests}: {getattr(exc, 'strerror', None) or exc}") \
            from exc


def check_endpoints(args: argparse.Namespace) -> None:
    if not args.endpoints:
        return
    from kvgate.epp.datastore import parse_endpoints

    try:
        parse_endpoints(args.endpoints)
    except ValueError as exc:
        raise SystemExit(f"kvgate epp: {exc}") from exc


def peer_sync_key(args: argparse.Namespace):
    """The pool's key for peer sync (PoolKey), or None without sync or with `--peer-sync-insecure`; a missing or
    bad key file, or a key flag without --peer-sync-bind, is a PeerSyncKeyError (kvgate's CLI: one line, exit 2)."""
    from kvgate.epp.peer_sync_keys import PeerSyncKeyError, load_pool_key

    if args.peer_sync_peer and not args.peer_sync_bind:
        raise SystemExit("kvgate epp: --peer-sync-peer needs --peer-sync-bind (peers sync both ways)")
    if getattr(args, "peer_sync_discover_pods", None) and not (args.peer_sync_bind and args.pool_name):
        raise PeerSyncKeyError("--peer-sync-discover-pods needs --peer-sync-bind and Kubernetes mode (--pool-name: "
                               "the pods are the pool's namespace's)")
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
