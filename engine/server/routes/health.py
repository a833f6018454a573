"""Readiness, liveness and the Prometheus page: three answers, for three readers.

- `/health` (readiness; what the EPP and a readiness probe ask): 200 only while the engine is ready and the
  server is not draining. 503 while loading, after SIGTERM (draining) and once the engine loop has died.
- `/live` (liveness): 200 unless the engine loop has died — loading and draining are alive — so a liveness
  probe restarts a server whose engine is gone but never one that is busy loading or finishing its streams.
- `/metrics`: the Prometheus text always, with status 503 whenever `/health` is 503 for a reason other than
  loading (draining, engine dead): a scraper that checks the status (the EPP) counts a failed scrape and
  stops routing there, instead of reading gauges that no longer move.

GET and HEAD /metrics are answered by the `MetricsPage` middleware, outside the rest of the stack: every EPP
scrapes every replica every 50 ms, and FastAPI's routing and dependency solving (which parses the query string
too) and the other middlewares would cost more than the page itself. The route below is what makes any other
method a 405.
"""

from __future__ import annotations

import functools
import urllib.parse

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvgate.engine.server.responses import error_response
from kvgate.engine.server.state import ServerState, server_state

router = APIRouter()


def _names_in(query_string: bytes) -> frozenset[str]:
    return frozenset(urllib.parse.parse_qs(query_string.decode("latin-1")).get("name[]", ()))  # as Starlette decodes


_cached_names_in = functools.lru_cache(maxsize=64)(_names_in)
_CACHED_QUERY_BYTES = 4096  # a scraper's query (the EPP's is well under this); a longer one is parsed every time


def scrape_names(query_string: bytes) -> frozenset[str]:
    """The `name[]` values of a /metrics query string. Cached: a scraper sends the same query every time, and
    parsing its dozen URL-encoded names is a large part of a scrape's cost; the cache holds at most 64 queries of
    at most 4 KiB, so varied queries only evict each other."""
    if not query_string:
        return frozenset()
    if len(query_string) > _CACHED_QUERY_BYTES:
        return _names_in(query_string)
    return _cached_names_in(query_string)


def metrics_page(server: ServerState, query_string: bytes) -> tuple[int, bytes]:
    """(status, Prometheus text) of /metrics for a query string."""
    # ?name[]=... narrows the page to those samples, as prometheus_client's own exposition does (SGLang's,
    # some vLLM versions'): the EPP asks for only the families it reads, every 50 ms.
    names = scrape_names(query_string)
    # 503 while the engine is starting, draining or dead: the EPP counts that as a failed scrape, so an engine
    # gets requests only while it can serve them (vLLM's server does not answer at all until it is ready).
    return 200 if server.not_serving_reason() is None else 503, server.metrics.page(names or None)


class MetricsPage:
    """GET (and HEAD) /metrics answered before the rest of the stack, from `server`'s metrics. Plain ASGI; every
    other request goes on to `app`."""

    def __init__(self, app, server: ServerState) -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/metrics" or scope["method"] not in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        status, body = metrics_page(self.server, scope.get("query_string", b""))
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", CONTENT_TYPE_LATEST.encode()), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body if scope["method"] == "GET" else b""})


@router.get("/health")
async def health(request: Request):
    why = server_state(request).not_serving_reason()
    return Response(status_code=200) if why is None else error_response(503, why, "server_error")


@router.get("/live")
async def live(request: Request):
    llm = server_state(request).llm
    if llm.error is not None:
        return error_response(503, f"the engine stopped: {llm.error}", "server_error")
    return Response(status_code=200)


# MetricsPage answers GET and HEAD before they get here; the route is what makes other methods a 405
@router.get("/metrics", include_in_schema=False)
async def prometheus_metrics(request: Request):
    status, body = metrics_page(server_state(request), request.scope.get("query_string", b""))
    return Response(body, media_type=CONTENT_TYPE_LATEST, status_code=status)
