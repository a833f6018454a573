"""HTTP through the Gateway under test, and the echo server's answers.

The backends of the upstream manifests run `echo-basic`, which answers every request with a JSON document
of what it received (path, host, method, headers) and who it is (pod, namespace). A test states what it
expects of a response; `expect_eventually` sends the request until that holds for `consecutive` answers in a
row (routes and endpoints take a moment to settle), as upstream's "eventually consistent" helper does.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from kvgate.conformance.cluster import ConformanceError
from kvgate.common.epp_protocol import TEST_ENDPOINT_SELECTION_HEADER as TEST_ENDPOINT_SELECTION


@dataclass(frozen=True)
class Request:
    host: str                      # Host header (a listener or route hostname); "" for the address itself
    path: str
    method: str = "GET"            # upstream's default; inference tests POST an OpenAI body
    headers: dict[str, str] = field(default_factory=dict)
    body: dict | None = None       # JSON body


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    echo: dict                     # the echo server's JSON, {} when the body was not one
    text: str

    @property
    def pod(self) -> str:
        return str(self.echo.get("pod", ""))

    @property
    def namespace(self) -> str:
        return str(self.echo.get("namespace", ""))

    @property
    def echoed_path(self) -> str:
        return str(self.echo.get("path", ""))

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())

    def describe(self) -> str:
        who = f" from pod {self.pod!r} ({self.namespace})" if self.pod else ""
        return f"HTTP {self.status}{who}: {self.text[:200]!r}"


def completion(prompt: str, model: str = "conformance-fake-model") -> dict:
    """The OpenAI completion body upstream's inference tests send."""
    return {"model": model, "prompt": prompt}


class Gateway:
    """Requests to one Gateway address (host:port)."""

    def __init__(self, address: str, timeout_s: float = 10.0) -> None:
        self.address = address
        self.client = httpx.Client(timeout=timeout_s, follow_redirects=False)

    def close(self) -> None:
        self.client.close()

    def send(self, req: Request) -> Response:
        headers = dict(req.headers)
        if req.host:
            headers["host"] = req.host
        body = json.dumps(req.body).encode() if req.body is not None else None
        if body is not None:
            headers.setdefault("content-type", "application/json")
        r = self.client.request(req.method, f"http://{self.address}{req.path}", headers=headers, content=body)
        try:
            echo = r.json()
            echo = echo if isinstance(echo, dict) else {}
        except ValueError:
            echo = {}
        return Response(r.status_code, {k.lower(): v for k, v in r.headers.items()}, echo, r.text)

    def try_send(self, req: Request) -> Response | None:
        try:
            return self.send(req)
        except httpx.HTTPError:
            return None

    def expect_eventually(self, req: Request, check, *, timeout_s: float, consecutive: int = 3,
                          interval_s: float = 0.5, what: str = "the expected response") -> Response:
        """Send `req` until `check(response)` is true for `consecutive` responses in a row.

        `check` returns True/False, or raises AssertionError with a reason (kept for the failure message)."""
        deadline = time.monotonic() + timeout_s
        streak, last = 0, "no response"
        while True:
            resp = self.try_send(req)
            ok = False
            if resp is None:
                last = f"request to {self.address}{req.path} failed"
            else:
                try:
                    ok = bool(check(resp))
                    last = resp.describe()
                except AssertionError as exc:
                    last = f"{resp.describe()} ({exc})"
            streak = streak + 1 if ok else 0
            if streak >= consecutive:
                return resp
            if time.monotonic() >= deadline:
                raise ConformanceError(f"{req.method} {req.host or self.address}{req.path}: timed out after "
                                       f"{timeout_s:.0f}s waiting for {what}; last: {last}")
            time.sleep(0 if ok else interval_s)
