"""Stand-in for the Gateway API conformance image `echo-basic`, run by the pod runner as a local process.

It answers like upstream echo-basic (sigs.k8s.io/gateway-api/conformance/echo-basic): every request gets a JSON
document with the request's path (request URI), host, method, proto and headers (Go-canonical names, lists of
values) and the context from the environment — NAMESPACE, INGRESS_NAME, SERVICE_NAME, POD_NAME. `/health`
answers `OK`, `/status/NNN` answers with that code, `?delay=1s` waits, and `X-Echo-Set-Header: K:V,...` sets
response headers. It listens on HTTP_PORT (3000) and H2C_PORT (3001), bound to the pod's IP.

The H2C port speaks cleartext HTTP/2 with prior knowledge (through the `h2` library) and answers 400
"Expected h2c request" to HTTP/1 requests, like upstream. With INCLUDE_HTTP_PORT_HEADER=true the document
also carries `httpPort`, the port that served the request (upstream's data-parallel backends set it).

Differences, on purpose: no TLS listener, no websocket, no gRPC mode, no HTTP/1.1 `Upgrade: h2c`.

It runs as `python echoserver.py` with no package on the path: the standard library, plus `h2` for the
H2C port when it is installed (without it that port answers HTTP/1 only).
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_go_duration(text: str) -> float:
    """'1.5s', '300ms', '1m30s' -> seconds (Go's time.ParseDuration for the forms tests use)."""
    parts = _DURATION.findall(text)
    if not parts or "".join(a + b for a, b in parts) != text:
        raise ValueError(f"time: invalid duration {text!r}")
    return sum(float(n) * _UNITS[u] for n, u in parts)


def canonical_header(name: str) -> str:
    """Go's textproto.CanonicalMIMEHeaderKey: 'x-foo-bar' -> 'X-Foo-Bar'."""
    return "-".join(p[:1].upper() + p[1:].lower() for p in name.split("-"))


def context_from_env(env: dict[str, str], port: int | None = None) -> dict[str, str]:
    out = {"namespace": env.get("NAMESPACE", ""), "ingress": env.get("INGRESS_NAME", ""),
           "service": env.get("SERVICE_NAME", ""), "pod": env.get("POD_NAME", "")}
    if port is not None and env.get("INCLUDE_HTTP_PORT_HEADER", "").lower() == "true":
        out["httpPort"] = str(port)
    return out


def echo_document(*, path: str, host: str, method: str, proto: str, headers: list[tuple[str, str]],
                  context: dict[str, str]) -> dict:
    """The body echo-basic sends back (RequestAssertions with the inline Context)."""
    grouped: dict[str, list[str]] = {}
    for k, v in headers:
        if k.lower() == "host":       # Go keeps Host out of Request.Header
            continue
        grouped.setdefault(canonical_header(k), []).append(v)
    return {"path": path, "host": host, "method": method, "proto": proto, "headers": grouped,
            **context, "sni": ""}


def echo_response_headers(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    out: dict[str, str] = {}
    for k, v in headers:
        if canonical_header(k) != "X-Echo-Set-Header":
            continue
        for kv in v.split(","):
            name, _, value = kv.strip().partition(":")
            out[name] = f"{out[name]},{value.strip()}" if name in out else value
    return list(out.items())


H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def serve_h2c(sock: socket.socket, context: dict[str, str]) -> None:
    """One HTTP/2 (prior knowledge) connection: each request stream gets the echo document."""
    import h2.config
    import h2.connection
    import h2.events

    conn = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    streams: dict[int, list[tuple[str, str]]] = {}
    sock.settimeout(60)
    while True:
        data = sock.recv(65536)
        if not data:
            return
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.RequestReceived):
                streams[event.stream_id] = list(event.headers)
                if event.stream_ended:
                    _answer_h2(conn, event.stream_id, streams.pop(event.stream_id), context)
            elif isinstance(event, h2.events.DataReceived):
                conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.StreamEnded) and event.stream_id in streams:
                _answer_h2(conn, event.stream_id, streams.pop(event.stream_id), context)
            elif isinstance(event, h2.events.ConnectionTerminated):
                sock.sendall(conn.data_to_send())
                return
        out = conn.data_to_send()
        if out:
            sock.sendall(out)


def _answer_h2(conn, stream_id: int, headers: list[tuple[str, str]], context: dict[str, str]) -> None:
    pseudo = {k: v for k, v in headers if k.startswith(":")}
    plain = [(k, v) for k, v in headers if not k.startswith(":")]
    doc = echo_document(path=pseudo.get(":path", "/"), host=pseudo.get(":authority", ""),
                        method=pseudo.get(":method", "GET"), proto="HTTP/2.0", headers=plain, context=context)
    body = json.dumps(doc, indent=1).encode()
    conn.send_headers(stream_id, [(":status", "200"), ("content-type", "application/json"),
                                  ("content-length", str(len(body))), *echo_response_headers(plain)])
    conn.send_data(stream_id, body, end_stream=True)


class H2CServer(ThreadingHTTPServer):
    """HTTP/2 with prior knowledge when a connection starts with the preface, else the HTTP/1 handler."""

    def __init__(self, address, handler, context: dict[str, str]):
        super().__init__(address, handler)
        self.context = context

    def process_request_thread(self, request, client_address):
        try:
            request.settimeout(10)
            first = request.recv(len(H2_PREFACE), socket.MSG_PEEK)
            if first.startswith(H2_PREFACE[:len(first)]) and len(first) >= 3 and _have_h2():
                try:
                    serve_h2c(request, self.context)
                except (OSError, ValueError) as exc:
                    sys.stdout.write(f"h2c connection from {client_address[0]} ended: {exc}\n")
                finally:
                    self.shutdown_request(request)
                return
        except OSError:
            self.shutdown_request(request)
            return
        super().process_request_thread(request, client_address)


def _have_h2() -> bool:
    try:
        import h2  # noqa: F401
        return True
    except ImportError:
        return False


def make_handler(context: dict[str, str], h2c: bool):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "echo-basic-k8srig"

        def log_message(self, fmt, *args):   # one line per request on stdout, like upstream
            sys.stdout.write(f"Echoing back request made to {self.path} to client ({self.client_address[0]})\n")
            sys.stdout.flush()

        def _send(self, code: int, body: bytes, ctype: str | None = None,
                  extra: list[tuple[str, str]] | None = None) -> None:
            self.send_response(code)
            for k, v in extra or []:
                self.send_header(k, v)
            if ctype:
                self.send_header("Content-Type", ctype)
                self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _read_body(self) -> bytes:
            """The request body, by Content-Length or chunked (a proxy streaming a body sends chunks): a
            body left unread would be parsed as the next request on this keep-alive connection."""
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                body = bytearray()
                while True:
                    size = int(self.rfile.readline().split(b";", 1)[0].strip() or b"0", 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                            pass
                        return bytes(body)
                    body += self.rfile.read(size)
                    self.rfile.readline()  # the CRLF after each chunk
            length = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(length) if length else b""

        def _handle(self) -> None:
            self._read_body()
            path = self.path.replace("//", "/")
            url = urlsplit(path)
            if h2c and self.headers.get("Upgrade", "").lower() != "h2c":
                return self._send(400, b"Expected h2c request")
            if url.path == "/health":
                return self._send(200, b"OK")
            if url.path.startswith("/status/"):
                m = re.fullmatch(r"/status/(\d\d\d)", url.path)
                return self._send(int(m.group(1)) if m else 400, b"")
            delay = parse_qs(url.query).get("delay")
            if delay:
                try:
                    time.sleep(parse_go_duration(delay[0]))
                except ValueError as e:
                    return self._send(500, json.dumps({"message": str(e)}).encode(), "application/json")
            headers = list(self.headers.items())
            doc = echo_document(path=self.path, host=self.headers.get("Host", ""), method=self.command,
                                proto=self.request_version, headers=headers, context=context)
            body = json.dumps(doc, indent=1).encode()
            self._send(200, body, "application/json", echo_response_headers(headers))

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _handle

    return Handler


def main() -> int:
    env = dict(os.environ)
    host = env.get("K8SRIG_POD_IP") or env.get("POD_IP") or "127.0.0.1"
    servers = []
    for port, h2c in ((int(env.get("HTTP_PORT") or 3000), False), (int(env.get("H2C_PORT") or 3001), True)):
        context = context_from_env(env, port)
        srv = (H2CServer((host, port), make_handler(context, h2c), context) if h2c
               else ThreadingHTTPServer((host, port), make_handler(context, h2c)))
        srv.daemon_threads = True
        servers.append(srv)
        print(f"Starting server, listening on {host}:{port} ({'h2c' if h2c else 'http'})", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    threads = [threading.Thread(target=s.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
               for s in servers]
    for t in threads:
        t.start()
    stop.wait()
    for s in servers:
        s.shutdown()
        s.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
