"""Where each endpoint publishes its KV events: from its pod's annotations, the EPP's flags, or an explicit
`--kv-events-endpoint` (engines sharing a host publish on other ports of it)."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

log = logging.getLogger("kvgate.epp.kv_events.subscriber")  # the logger these warnings always had

_TCP_SOCKET = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[0-9.]+|[A-Za-z0-9.-]+):\d{1,5}")


@dataclass(frozen=True)
class EventSource:
    """Where an endpoint publishes its events."""

    address: str  # the endpoint ("ip:port"), the index's key
    endpoint: str  # tcp://ip:port of its PUB socket
    replay_endpoint: str | None = None
    topic: str = ""

    def with_topic(self, topic: str) -> "EventSource":
        return EventSource(self.address, self.endpoint, self.replay_endpoint, topic)


def event_source(endpoint, port: int | None, replay_port: int | None, topic: str) -> EventSource | None:
    """Where `endpoint` (an epp.types.Endpoint) publishes: its pod's kvgate.dev/kv-events-* annotations, else
    the flags' ports, on the endpoint's IP; None when neither names a port (or an annotation is not a port)."""
    from kvgate.common.epp_protocol import (KV_EVENTS_PORT_ANNOTATION, KV_EVENTS_REPLAY_PORT_ANNOTATION,
                                     KV_EVENTS_TOPIC_ANNOTATION)

    notes = endpoint.annotations
    try:
        if KV_EVENTS_PORT_ANNOTATION in notes:
            port = _port(notes[KV_EVENTS_PORT_ANNOTATION])
        if KV_EVENTS_REPLAY_PORT_ANNOTATION in notes:
            replay_port = _port(notes[KV_EVENTS_REPLAY_PORT_ANNOTATION])
    except ValueError as exc:
        log.warning("endpoint %s: %s; no KV events from it", endpoint.address, exc)
        return None
    if port is None:
        return None
    host = endpoint.address.rsplit(":", 1)[0]  # "ip" or "[v6]"
    topic = notes.get(KV_EVENTS_TOPIC_ANNOTATION, topic)
    return EventSource(endpoint.address, f"tcp://{host}:{port}",
                       f"tcp://{host}:{replay_port}" if replay_port else None, topic)


def is_tcp_socket(text: str) -> bool:
    """A ZeroMQ tcp://HOST:PORT (an IPv6 host in brackets) with a port in 1-65535."""
    return bool(_TCP_SOCKET.fullmatch(text)) and 0 < int(text.rpartition(":")[2]) < 65536


def parse_event_endpoint(text: str) -> EventSource:
    """`ENDPOINT=PUB[,REPLAY]` (`kvgate epp --kv-events-endpoint`), e.g. 127.0.0.2:8000=tcp://[::1]:5557 — where one
    endpoint publishes when it is not at its own IP (engines sharing a host); ValueError naming the problem."""
    from kvgate.epp.datastore import parse_endpoint

    address, sep, sockets = text.partition("=")
    if not sep:
        raise ValueError(f"{text!r} is not ENDPOINT=PUB[,REPLAY]")
    parse_endpoint(address.strip())
    parts = [p.strip() for p in sockets.split(",")]
    if len(parts) > 2 or not all(is_tcp_socket(p) for p in parts):
        raise ValueError(f"{text!r}: expected one or two tcp://HOST:PORT sockets after '='")
    return EventSource(address.strip(), parts[0], parts[1] if len(parts) == 2 else None)


def _port(text: str) -> int:
    if not text.strip().isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"KV-events port annotation {text!r} is not a port number")
    return int(text)
