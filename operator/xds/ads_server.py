"""The operator's ADS server (envoy.service.discovery.v3.AggregatedDiscoveryService, state of the world, over
gRPC): each Envoy stream follows ads_stream.py's rules on the snapshots of a SnapshotCache.

Bounded: at most `max_streams` streams at once (more are refused with RESOURCE_EXHAUSTED), requests of at most
1 MiB and 64 of them waiting per stream, responses of at most 16 MiB, keepalive pings every 30 s so that a
vanished Envoy frees its stream. The
server runs its own asyncio loop in a daemon thread. What each Envoy ACKed or NACKed goes to `on_status(node id,
envoy, snapshot version, error)` — called on the loop; it must not block.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Callable

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc

from kvgate.operator.xds.ads_stream import AdsStream
from kvgate.operator.xds.snapshot_cache import SnapshotCache

log = logging.getLogger("kvgate.operator.xds")

MAX_REQUEST_BYTES = 1 << 20
MAX_RESPONSE_BYTES = 16 << 20
DEFAULT_MAX_STREAMS = 1000
STREAM_QUEUE = 64  # requests (and snapshot wake-ups) waiting per stream
_WAKE = object()
StatusCallback = Callable[[str, str, str, str], None]


class _Servicer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    def __init__(self, server: "AdsServer") -> None:
        self.server = server

    async def StreamAggregatedResources(self, request_iterator, context):
        # Bounded: a client that sends faster than it is answered is held by gRPC's flow control.
        queue: asyncio.Queue = asyncio.Queue(maxsize=STREAM_QUEUE)
        stream = AdsStream()
        cache, peer = self.server.cache, context.peer()

        async def read() -> None:
            try:
                async for request in request_iterator:
                    await queue.put(request)
            except (grpc.RpcError, asyncio.CancelledError):
                pass
            finally:
                while queue.full():  # the stream is ending: what is still queued no longer matters
                    queue.get_nowait()
                queue.put_nowait(None)

        reader = asyncio.ensure_future(read())
        self.server.streams.add(queue)
        last_status = None
        try:
            while True:
                item = await queue.get()
                if item is None:
                    return
                if item is _WAKE:
                    responses = stream.pending(cache.get(stream.node_id)) if stream.node_id else []
                else:
                    if not stream.node_id and not item.node.id:
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first request carries no node id")
                    responses = stream.on_request(item, cache.get(stream.node_id or item.node.id), peer)
                for response in responses:
                    yield response
                status = stream.status(cache.get(stream.node_id))
                if status is not None and status != last_status:
                    last_status = status
                    version, error = status
                    if error:
                        log.warning("Envoy %s of %s rejected config %s: %s", stream.envoy, stream.node_id, version,
                                    error)
                    self.server.on_status(stream.node_id, stream.envoy, version, error)
        finally:
            self.server.streams.discard(queue)
            reader.cancel()


class AdsServer:
    def __init__(self, cache: SnapshotCache, host: str = "0.0.0.0", port: int = 18000,
                 max_streams: int = DEFAULT_MAX_STREAMS, on_status: StatusCallback | None = None) -> None:
        self.cache, self.host, self.port, self.max_streams = cache, host, port, max_streams
        self.on_status = on_status or (lambda *_: None)
        self.streams: set[asyncio.Queue] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        cache.watch(self._snapshot_changed)

    def _snapshot_changed(self, node_id: str) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake_all)

    def _wake_all(self) -> None:
        for queue in list(self.streams):
            if not queue.full():  # a full queue's requests each look at the new snapshot anyway
                queue.put_nowait(_WAKE)

    async def _serve(self) -> None:
        self._server = grpc.aio.server(maximum_concurrent_rpcs=self.max_streams, options=[
            ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
            ("grpc.max_send_message_length", MAX_RESPONSE_BYTES),
            ("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ("grpc.so_reuseport", 0)])
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(_Servicer(self), self._server)
        self.port = self._server.add_insecure_port(f"{self.host}:{self.port}")
        if not self.port:
            raise OSError(f"cannot listen on {self.host}")
        await self._server.start()

    def start(self) -> int:
        """Listen and serve in a daemon thread; the port listened on (0 asks for a free one)."""
        def run() -> None:
            self._loop = asyncio.new_event_loop()
            try:
                self._loop.run_until_complete(self._serve())
            except BaseException as exc:  # noqa: BLE001 - handed to start()'s caller
                self._error = exc
                self._started.set()
                return
            self._started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="kvgate-xds", daemon=True)
        self._thread.start()
        self._started.wait(30)
        if self._error is not None:
            raise self._error
        log.info("xDS server listening on %s:%d (at most %d streams)", self.host, self.port, self.max_streams)
        return self.port

    def stop(self, grace_s: float = 1.0) -> None:
        loop = self._loop
        if loop is None or self._server is None:
            return
        asyncio.run_coroutine_threadsafe(self._server.stop(grace_s), loop).result(grace_s + 5)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(5)
