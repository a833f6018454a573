"""The rig's kube-proxy: a userspace TCP proxy from each Service's clusterIP:port to its ready endpoints.

Service cluster IPs are on loopback (the rig gives the API server a range inside its own 127.N/16), so the
pod runner can listen on every clusterIP:port itself and forward each accepted connection to one ready
endpoint, round robin — as kube-proxy's userspace mode did. The Services and their EndpointSlices are re-read
every SYNC_S: listeners open and close as Services and ports come and go, and backends follow readiness.
(EndpointSlices, not Endpoints: the API server refuses loopback addresses in Endpoints, so on the rig only
the EndpointSlice controller's objects list the pods.) A Service with no ready endpoint accepts and closes at once
(the client sees a reset), so clients fail fast. Headless and ExternalName Services get no listener.

`desired_listeners` is pure (objects in, listeners out); `ServiceProxy` applies it.
"""
from __future__ import annotations

import itertools
import logging
import socket
import threading
from typing import NamedTuple

log = logging.getLogger("k8srig.serviceproxy")

SYNC_S = 0.5
CONNECT_TIMEOUT_S = 2.0
BUFFER = 65536


class Backend(NamedTuple):
    ip: str
    port: int


def desired_listeners(services: list[dict], slices: list[dict]) -> dict[tuple[str, int], list[Backend]]:
    """{(clusterIP, port): ready backends} for every TCP port of every Service with a cluster IP."""
    by_service: dict[tuple[str, str], list[dict]] = {}
    for sl in slices:
        meta = sl.get("metadata") or {}
        owner = (meta.get("labels") or {}).get("kubernetes.io/service-name")
        if owner:
            by_service.setdefault((meta.get("namespace"), owner), []).append(sl)
    out: dict[tuple[str, int], list[Backend]] = {}
    for svc in services:
        meta, spec = svc.get("metadata") or {}, svc.get("spec") or {}
        ip = spec.get("clusterIP")
        if not ip or ip == "None" or spec.get("type") == "ExternalName":
            continue
        for port in spec.get("ports") or []:
            if port.get("protocol", "TCP") != "TCP":
                continue
            backends = []
            for sl in by_service.get((meta.get("namespace"), meta.get("name")), []):
                # Slices name their ports after the Service's (an unnamed Service port: name "").
                numbers = [int(p["port"]) for p in sl.get("ports") or []
                           if (p.get("name") or "") == (port.get("name") or "") and p.get("port")]
                for ep in sl.get("endpoints") or []:
                    if (ep.get("conditions") or {}).get("ready") is False:
                        continue
                    backends += [Backend(address, n) for address in ep.get("addresses") or [] for n in numbers]
            out[(ip, int(port["port"]))] = sorted(set(backends))
    return out


class _Listener:
    """One clusterIP:port: accepts, picks the next backend, pumps bytes both ways."""

    def __init__(self, address: tuple[str, int], backends: list[Backend]) -> None:
        self.address = address
        self.backends = backends
        self._next = itertools.count()
        self._stop = threading.Event()
        self.sock = socket.create_server(address, reuse_port=False)
        self.sock.settimeout(0.5)
        self.thread = threading.Thread(target=self._accept_loop, name=f"svc-{address[0]}:{address[1]}", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        self.thread.join(timeout=2)

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        backends = list(self.backends)
        upstream = None
        for _ in range(len(backends)):  # a backend that refuses is skipped, as kube-proxy's userspace mode did
            backend = backends[next(self._next) % len(backends)]
            try:
                upstream = socket.create_connection(backend, timeout=CONNECT_TIMEOUT_S)
                break
            except OSError:
                continue
        if upstream is None:
            _close(client)
            return
        upstream.settimeout(None)
        client.settimeout(None)
        t = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
        t.start()
        _pump(client, upstream)
        t.join()
        _close(client)
        _close(upstream)


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(BUFFER):
            dst.sendall(data)
    except OSError:
        pass
    try:
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def _close(s: socket.socket) -> None:
    try:
        s.close()
    except OSError:
        pass


class ServiceProxy:
    def __init__(self, client) -> None:
        self.client = client
        self.listeners: dict[tuple[str, int], _Listener] = {}
        self._failed: set[tuple[str, int]] = set()

    def sync(self) -> None:
        from .kube import CORE, ENDPOINTSLICE

        desired = desired_listeners(self.client.list(CORE["Service"])["items"],
                                    self.client.list(ENDPOINTSLICE)["items"])
        for address in set(self.listeners) - set(desired):
            self.listeners.pop(address).close()
            log.info("service %s:%d: closed", *address)
        for address, backends in desired.items():
            listener = self.listeners.get(address)
            if listener is not None:
                listener.backends = backends
                continue
            try:
                self.listeners[address] = _Listener(address, backends)
                self._failed.discard(address)
                log.info("service %s:%d: listening -> %s", *address, ", ".join(f"{b.ip}:{b.port}" for b in backends))
            except OSError as exc:
                if address not in self._failed:
                    self._failed.add(address)
                    log.warning("service %s:%d: cannot listen: %s", *address, exc)

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.sync()
            except Exception as exc:  # noqa: BLE001 - API hiccups: keep the listeners, try again
                log.warning("service sync failed: %s", exc)
            stop.wait(SYNC_S)
        for listener in self.listeners.values():
            listener.close()
        self.listeners.clear()
