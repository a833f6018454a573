"""A keep-alive HTTP/1.1 GET for /metrics scrapes: a small asyncio protocol, driven by callbacks.

A general-purpose client such as httpx spends enough CPU per scrape that one core could scrape only a few dozen
endpoints every 50 ms (`kvgate bench scrape` prints this client's cost). This client writes one prepared request and
feeds what arrives to httptools' response parser (llhttp) in `data_received`: no task, future or timer per scrape on the
collector's path (`send` + a callback; the collector's ticker enforces the timeout). `get()` is the awaitable form, with
its own timer, for one-off callers.

An engine's answer is input: the parser's work is linear in the bytes received (a body in 1-byte chunks costs its
wire bytes, not their square), the headers are bounded (MAX_HEADER_BYTES), the body is bounded (`max_bytes`, the
EPP's --metrics-max-bytes) and so are the bytes on the wire for it (chunk framing included) and its chunks
(MAX_CHUNKS): past any of them the scrape fails at once and the connection is dropped. A body that never ends is
cut by the timeout. `cost_s` is the CPU this connection's last answer took to read, which the collector charges to
its endpoint.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httptools

# (status, body, None) for an answer, (0, b"", error) for a failure; called exactly once per send().
Done = Callable[[int, bytes, "BaseException | None"], None]

MAX_HEADER_BYTES = 65536  # status line and headers of one answer
MAX_CHUNKS = 65536  # of one chunked body: each costs a parser callback (a 4 MiB page in 64-byte writes is in)
DEFAULT_MAX_BYTES = 4 << 20  # a body: a real vLLM page with its histograms and LoRA info is ~100-300 KiB
WIRE_OVERHEAD = 2  # the body's wire bytes (chunk framing) may be at most this many times max_bytes


class ScrapeError(Exception):
    """A failed scrape; `reason` is its kind as the EPP's metrics count it (too_large, malformed, http_status...)."""

    def __init__(self, message: str, reason: str = "malformed") -> None:
        super().__init__(message)
        self.reason = reason


class MetricsConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection that GETs one URL path, body by Content-Length or chunked.

    Only what a /metrics scrape needs: no redirects, no compression (we ask for identity), no proxies, no body
    read until the connection closes. A timeout or any protocol surprise closes the connection; the next request
    reconnects.
    """

    def __init__(self, address: str, path: str = "/metrics", timeout: float = 1.0,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        host, _, port = address.rpartition(":")
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        self.address = address
        self.host, self.port = host.strip("[]"), int(port)
        self.timeout = timeout
        self.max_bytes = max_bytes
        self.path = ""
        self.request = b""
        self.set_path(path)
        self.transport: asyncio.Transport | None = None
        self._done: Done | None = None
        self._parser: httptools.HttpResponseParser | None = None
        self._chunks: list[bytes] = []
        self._body_bytes = 0
        self._wire_bytes = 0  # received for this answer
        self._headers_done = False
        self._framed = False  # Content-Length or chunked: the body's end is known without the connection's
        self._complete = False
        self._keep_alive = True
        self._chunk_count = 0
        self.cost_s = 0.0  # CPU seconds this thread spent reading the current (or last) answer

    def set_path(self, path: str) -> None:
        self.path = path
        self.request = (f"GET {path} HTTP/1.1\r\nHost: {self.address}\r\nAccept: text/plain\r\n"
                        f"Accept-Encoding: identity\r\nUser-Agent: kvgate-epp\r\n\r\n").encode()

    @property
    def connected(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    @property
    def busy(self) -> bool:
        return self._done is not None

    async def connect(self) -> None:
        """Open the connection (within `timeout`); raises OSError or TimeoutError."""
        if self.connected:
            return
        self.transport = None
        self.cost_s = 0.0  # a failed connect reads nothing: the last answer's cost is not this scrape's
        loop = asyncio.get_running_loop()
        await asyncio.wait_for(loop.create_connection(lambda: self, self.host, self.port), self.timeout)

    def send(self, done: Done) -> None:
        """Write one GET on the open connection; `done` gets the answer or the failure, exactly once."""
        if self._done is not None:
            raise RuntimeError("a request is already in flight on this connection")
        if not self.connected:
            done(0, b"", ScrapeError("not connected", "connect"))
            return
        self._parser = httptools.HttpResponseParser(self)
        self._chunks = []
        self._body_bytes = self._wire_bytes = 0
        self._headers_done = self._framed = self._complete = False
        self._chunk_count = 0
        self.cost_s = 0.0
        self._done = done
        self.transport.write(self.request)

    def abort(self, exc: BaseException) -> None:
        """Fail the request in flight (e.g. on timeout) and drop the connection: its answer would be late."""
        self._fail(exc)

    async def get(self) -> tuple[int, bytes]:
        """(status, body) of one GET, connecting first if needed; raises ScrapeError, OSError or TimeoutError."""
        await self.connect()
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()

        def done(status: int, body: bytes, exc: BaseException | None) -> None:
            if not waiter.done():
                waiter.set_exception(exc) if exc is not None else waiter.set_result((status, body))

        timer = loop.call_later(self.timeout, self.abort, TimeoutError(f"no answer in {self.timeout}s"))
        try:
            self.send(done)
            return await waiter
        finally:
            timer.cancel()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.transport = None
        self._fail(exc or ScrapeError("connection closed", "connect"))

    def data_received(self, data: bytes) -> None:
        if self._done is None or self._parser is None:
            self.close()  # bytes nobody asked for: the stream is out of step
            return
        self._wire_bytes += len(data)
        started = time.thread_time()
        try:
            if self._wire_bytes > WIRE_OVERHEAD * self.max_bytes + MAX_HEADER_BYTES:
                raise ScrapeError(f"response larger than {WIRE_OVERHEAD} x {self.max_bytes} bytes on the wire",
                                  "too_large")
            self._parser.feed_data(data)
            if not self._headers_done and self._wire_bytes > MAX_HEADER_BYTES:
                raise ScrapeError("response headers too large", "too_large")
            out_of_step = False
        except (httptools.HttpParserError, httptools.HttpParserUpgrade, ScrapeError) as e:
            self.cost_s += time.thread_time() - started
            if not self._complete:
                self._fail(e if isinstance(e, ScrapeError) else _parser_error(e))
                return
            out_of_step = True  # bytes past the answer that do not parse: the answer stands, the connection goes
        else:
            self.cost_s += time.thread_time() - started
        if self._complete:
            parser, self._parser = self._parser, None
            done, self._done = self._done, None
            if out_of_step or not self._keep_alive:
                self.close()
            done(parser.get_status_code(), b"".join(self._chunks), None)
            self._chunks = []

    def _fail(self, exc: BaseException) -> None:
        done, self._done = self._done, None
        self._parser = None
        self._chunks = []
        self.close()
        if done is not None:
            done(0, b"", exc)

    # httptools' callbacks (an exception raised here surfaces from feed_data as an HttpParserCallbackError)
    def on_header(self, name: bytes, value: bytes) -> None:
        if self._complete:
            return
        name = name.lower()
        if name == b"content-length":
            length = int(value)  # llhttp has checked the digits
            if length > self.max_bytes:
                raise ScrapeError(f"response body of {length} bytes is over the limit of {self.max_bytes}",
                                  "too_large")
            self._framed = True
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            self._framed = True

    def on_headers_complete(self) -> None:
        if self._complete:
            return
        self._headers_done = True
        self._keep_alive = self._parser.should_keep_alive()  # llhttp's answer holds only until the message ends
        if not self._framed:
            raise ScrapeError("response has neither Content-Length nor chunked encoding")

    def on_body(self, body: bytes) -> None:
        if self._complete:
            return  # a server writing ahead: not this answer's (the next send() starts a new parser)
        self._body_bytes += len(body)
        if self._body_bytes > self.max_bytes:
            raise ScrapeError(f"response body over the limit of {self.max_bytes} bytes", "too_large")
        self._chunks.append(body)

    def on_chunk_header(self) -> None:
        self._chunk_count += 1
        if self._chunk_count > MAX_CHUNKS + 1:  # the last, empty chunk is not one of the body's
            raise ScrapeError(f"response body in more than {MAX_CHUNKS} chunks", "too_large")

    def on_message_complete(self) -> None:
        self._complete = True


def _parser_error(e: BaseException) -> ScrapeError:
    """A parser error as a ScrapeError: a callback's own where it raised one."""
    if isinstance(e, httptools.HttpParserUpgrade):
        return ScrapeError("the engine answered with a protocol upgrade")
    cause = e.__context__ if isinstance(e, httptools.HttpParserCallbackError) else None
    return cause if isinstance(cause, ScrapeError) else ScrapeError(f"malformed HTTP response: {e}")
