"""The `x-kvgate-endpoint` response header: which replica answered, as the address the connection reached."""

from __future__ import annotations

import functools
import ipaddress

SERVER_ID_HEADER = "x-kvgate-endpoint"


@functools.lru_cache(maxsize=64)
def _endpoint_header(host: str, port: int | None, fallback: str) -> tuple[bytes, bytes]:
    """(header name, "ip:port") for a connection's local address; an IPv4-mapped IPv6 address as plain IPv4."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:  # not an IP (a Unix socket path): what the server was told to listen on
        return SERVER_ID_HEADER.encode(), fallback.encode()
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    address = f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"
    return SERVER_ID_HEADER.encode(), address.encode()


def local_address(scope) -> str:
    """The "ip:port" a request's connection reached (what the header names); "" when the socket has none."""
    local = scope.get("server")
    return _endpoint_header(str(local[0]), local[1], "")[1].decode() if local else ""


class ServerIdMiddleware:
    """Adds which replica answered to every response (plain ASGI: streaming and disconnects untouched): the
    address this connection reached (its socket's local address, ASGI's scope["server"]), so a server listening
    on 0.0.0.0 (every pod the operator makes) names its pod IP, not the any-address it was told."""

    def __init__(self, app, server_id: str) -> None:
        self.app = app
        self.fallback = server_id

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        local = scope.get("server")
        header = _endpoint_header(str(local[0]), local[1], self.fallback) if local else \
            (SERVER_ID_HEADER.encode(), self.fallback.encode())

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), header]
            await send(message)

        await self.app(scope, receive, send_with_id)
