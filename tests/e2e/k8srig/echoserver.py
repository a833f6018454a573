"""Stand-in for the Gateway API conformance image `echo-basic`, run by the pod runner as a local process.

It answers like upstream echo-basic (sigs.k8s.io/gateway-api/conformance/echo-basic): every request gets a JSON
document with the request's path (request URI), host, method, proto and headers (Go-canonical names, lists of
values) and the context from the environment — NAMESPACE, INGRESS_NAME, SERVICE_NAME, POD_NAME. `/health`
answers `OK`, `/status/NNN` answers with that code, `?delay=1s` waits, and `X-Echo-Set-Header: K:V,...` sets
response headers. It listens on HTTP_PORT (3000) and H2C_PORT (3001), bound to the pod's IP.

Differences, on purpose: no TLS listener, no websocket, no gRPC mode, and the H2C port speaks HTTP/1.1 only
(it answers 400 "Expected h2c request" to requests without `Upgrade: h2c`, like upstream does to HTTP/1 ones).

Standard library only: it runs as `python echoserver.py` with no package on the path.
"""
from __future__ import annotations

import json
import os
import re
import signal
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


def context_from_env(env: dict[str, str]) -> dict[str, str]:
    return {"namespace": env.get("NAMESPACE", ""), "ingress": env.get("INGRESS_NAME", ""),
            "service": env.get("SERVICE_NAME", ""), "pod": env.get("POD_NAME", "")}


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

        def _handle(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
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
    context = context_from_env(env)
    servers = []
    for port, h2c in ((int(env.get("HTTP_PORT") or 3000), False), (int(env.get("H2C_PORT") or 3001), True)):
        srv = ThreadingHTTPServer((host, port), make_handler(context, h2c))
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
