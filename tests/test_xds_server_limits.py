"""The ADS server's limits over real gRPC: streams beyond --xds-max-streams are refused, a stream whose first
request names no node is ended, an oversized request is refused, and a client is answered from its node's
snapshot only."""

from __future__ import annotations

import queue

import grpc
import pytest
from envoy.service.discovery.v3 import ads_pb2_grpc
from envoy.service.discovery.v3.discovery_pb2 import DiscoveryRequest

from kvgate.operator.xds.ads_server import MAX_REQUEST_BYTES, AdsServer
from kvgate.operator.xds.snapshot import CLUSTER, Snapshot
from kvgate.operator.xds.snapshot_cache import SnapshotCache
from tests.operator.test_xds import _files

pytestmark = pytest.mark.processes  # a gRPC server on loopback


def _request(node: str = "ns/gw", names: list[str] = ()) -> DiscoveryRequest:
    request = DiscoveryRequest(type_url=CLUSTER, resource_names=list(names))
    request.node.id = node
    return request


class Stream:
    def __init__(self, channel: grpc.Channel, timeout: float = 30.0) -> None:
        self.requests: queue.Queue = queue.Queue()
        self.responses = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources(
            iter(self.requests.get, None), timeout=timeout)

    def send(self, request: DiscoveryRequest) -> None:
        self.requests.put(request)

    def close(self) -> None:
        self.requests.put(None)
        self.responses.cancel()


def test_limits():
    cache = SnapshotCache()
    snapshot = Snapshot.from_files(_files())
    cache.set("ns/gw", snapshot)
    server = AdsServer(cache, "127.0.0.1", 0, max_streams=1)
    port = server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            first = Stream(channel)
            first.send(_request())
            response = next(first.responses)
            assert response.version_info == snapshot.versions[CLUSTER] and len(response.resources) == 6
            second = Stream(channel)  # one stream already: refused
            second.send(_request())
            with pytest.raises(grpc.RpcError) as refused:
                next(second.responses)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            first.close()
    finally:
        server.stop()

    server = AdsServer(cache, "127.0.0.1", 0)  # the rest with room for streams
    port = server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            nameless = Stream(channel)
            nameless.send(_request(node=""))
            with pytest.raises(grpc.RpcError) as ended:
                next(nameless.responses)
            assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            huge = Stream(channel)
            huge.send(_request(names=["x" * 1000] * (MAX_REQUEST_BYTES // 1000 + 10)))
            with pytest.raises(grpc.RpcError) as too_big:
                next(huge.responses)
            assert too_big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stranger = Stream(channel, timeout=2.0)  # a node this server has no config for: nothing is sent
            stranger.send(_request(node="other/gw"))
            cache.set("ns/gw", Snapshot.from_files(_files(weights=(1, 1))))  # a wake-up: still nothing for it
            with pytest.raises(grpc.RpcError) as quiet:
                next(stranger.responses)  # ends at the call's deadline, never with a response
            assert quiet.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            stranger.close()
    finally:
        server.stop()
