"""One Envoy's ADS stream, state of the world: what to answer to each DiscoveryRequest and each new snapshot.

The protocol rules kept here (envoy/api/envoy/service/discovery/v3/discovery.proto and the xDS protocol doc):

- A request whose `response_nonce` is not the nonce of the last response of its type is stale (it answers an
  older response) and is ignored. One that names the last nonce is an ACK, or a NACK when it carries
  `error_detail`: Envoy kept its previous config of that type and says why.
- One response of a type at a time: the next goes once Envoy answered the last (ACK or NACK). A NACKed version
  is not sent again; the next snapshot is.
- A stream's first request of a type (no nonce) carries the version Envoy already has (after a reconnect, to this
  or another operator replica): when that is the snapshot's, nothing is sent, so a restarted operator changes
  nothing in a serving Envoy.
- Make before break: clusters first; endpoints once their clusters' version was sent; listeners and route
  tables only once Envoy ACKed the clusters (and the endpoints it asked for) of the same snapshot, so a route
  never names a cluster Envoy does not have yet. Removals need no ordering here: a cluster whose routes are gone
  lingers in the snapshot (gateway.retain_retired_clusters) after the routes leave.

Listeners and clusters are sent whole; route tables and endpoints as Envoy names them. Each response's
version_info is the type's version (snapshot.py), its nonce a counter of the stream.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from envoy.service.discovery.v3.discovery_pb2 import DiscoveryRequest, DiscoveryResponse

from kvgate.operator.xds.snapshot import CLUSTER, ENDPOINT, LISTENER, ROUTE, TYPE_ORDER, Snapshot

MAX_ERROR_CHARS = 1024  # of a NACK's error text carried to the Gateway's condition
MAX_NAMES = 10_000  # resource names one request may subscribe to


@dataclass
class TypeState:
    requested: bool = False  # Envoy subscribed to the type
    names: tuple[str, ...] = ()  # what it asked for (route tables, endpoints)
    nonce: str = ""  # of the last response
    awaiting: bool = False  # that response is not answered yet
    sent: tuple[str | None, tuple[str, ...]] = (None, ())  # (version, names) of the last response
    acked: str | None = None  # the version Envoy has
    nacked: tuple[str, str] | None = None  # (version, error) of the last response, when Envoy rejected it


@dataclass
class AdsStream:
    node_id: str = ""
    envoy: str = ""  # which Envoy: its pod's name (node metadata "pod"), else the peer address
    listen_host: str | None = None  # node metadata "listen_host": bind listeners there, not on the any-address
    types: dict[str, TypeState] = field(default_factory=lambda: {t: TypeState() for t in TYPE_ORDER})
    _counter: int = 0

    def on_request(self, request: DiscoveryRequest, snapshot: Snapshot | None, peer: str = "") -> list[DiscoveryResponse]:
        if not self.node_id:
            self.node_id = request.node.id
            pod = request.node.metadata.fields.get("pod")
            self.envoy = (pod.string_value if pod is not None else "") or peer
            host = request.node.metadata.fields.get("listen_host")
            self.listen_host = _ip(host.string_value) if host is not None else None
        state = self.types.get(request.type_url)
        if state is None:
            return []  # a type this server does not serve (Envoy then waits for it as for an absent resource)
        if request.response_nonce:
            if request.response_nonce != state.nonce:
                return []  # stale: answers an older response
            state.awaiting = False
            if request.HasField("error_detail"):
                state.nacked = (state.sent[0], request.error_detail.message[:MAX_ERROR_CHARS])
            else:
                state.acked, state.nacked = state.sent[0], None
        elif not state.requested and request.version_info:
            # A reconnect: Envoy has this version. Sent already, as far as this stream goes, if it is current.
            state.acked = request.version_info
            state.sent = (request.version_info, tuple(sorted(set(request.resource_names)))[:MAX_NAMES])
        state.requested = True
        state.names = tuple(sorted(set(request.resource_names)))[:MAX_NAMES]
        return self.pending(snapshot)

    def pending(self, snapshot: Snapshot | None) -> list[DiscoveryResponse]:
        """The responses due now, in make-before-break order."""
        if snapshot is None:
            return []  # this replica has no config for the node (yet): Envoy keeps its own
        out = []
        for type_url in TYPE_ORDER:
            state = self.types[type_url]
            if not state.requested or state.awaiting or not self._prerequisites_met(type_url, snapshot):
                continue
            version = snapshot.versions[type_url]
            names = () if type_url in (LISTENER, CLUSTER) else state.names
            if state.sent == (version, names) or (state.nacked and state.nacked[0] == version
                                                  and state.sent[1] == names):
                continue
            self._counter += 1
            state.nonce, state.awaiting, state.sent = str(self._counter), True, (version, names)
            out.append(DiscoveryResponse(version_info=version, type_url=type_url, nonce=state.nonce,
                                         resources=snapshot.select(type_url, list(names), self.listen_host)))
        return out

    def _prerequisites_met(self, type_url: str, snapshot: Snapshot) -> bool:
        clusters, endpoints = self.types[CLUSTER], self.types[ENDPOINT]
        if type_url == CLUSTER:
            return True
        if type_url == ENDPOINT:
            return clusters.sent[0] == snapshot.versions[CLUSTER]
        endpoints_ok = not endpoints.names or endpoints.acked == snapshot.versions[ENDPOINT]
        return clusters.acked == snapshot.versions[CLUSTER] and endpoints_ok

    def status(self, snapshot: Snapshot | None) -> tuple[str, str] | None:
        """(snapshot version, "") once Envoy ACKed every type of the snapshot it uses; (version, error) when it
        NACKed a type of it; None while it is on its way."""
        if snapshot is None or not self.node_id:
            return None
        for type_url in TYPE_ORDER:
            nacked = self.types[type_url].nacked
            if nacked and nacked[0] == snapshot.versions[type_url]:
                return snapshot.version, f"{type_url.rsplit('.', 1)[-1]}: {nacked[1]}"
        used = [CLUSTER, LISTENER] + [t for t in (ENDPOINT, ROUTE) if snapshot.resources[t]]
        if all(self.types[t].acked == snapshot.versions[t] for t in used):
            return snapshot.version, ""
        return None


def _ip(text: str) -> str | None:
    """`text` if it is an IP address (what an Envoy's listen_host must be), else None."""
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        return None
