"""Assertions the conformance tests share: statuses of routes and pools, pods, and traffic through a Gateway.

Each waits (bounded by the run's Timing) for the cluster to reach the stated state and raises
ConformanceError with what it last observed otherwise, as upstream's helpers do.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

from kvgate.conformance import resources as res
from kvgate.conformance.cluster import ConformanceError, conditions_of, parent_entry, wait_until
from kvgate.conformance.suite import Context
from kvgate.conformance.traffic import Request, Response

NN = tuple[str, str]  # (namespace, name)


def _status_text(obj: dict | None) -> str:
    return json.dumps((obj or {}).get("status") or {}, sort_keys=True)[:1500]


# --- HTTPRoute -----------------------------------------------------------------------------------------------

def route_must_have_condition(ctx: Context, route: NN, gateway: NN, type_: str, status: str,
                              reason: str | None = None) -> None:
    def holds() -> bool:
        obj = ctx.cluster.get(res.HTTPROUTE, route[1], route[0])
        cond = conditions_of(parent_entry(obj, gateway[0], gateway[1], route[0])).get(type_)
        return bool(cond) and cond.get("status") == status and reason in (None, cond.get("reason"))

    want = f"{type_}={status}" + (f" ({reason})" if reason else "")
    wait_until(holds, ctx.timing.condition_s, f"HTTPRoute {'/'.join(route)} to have {want} for Gateway "
               f"{'/'.join(gateway)}", describe=lambda: _status_text(ctx.cluster.get(res.HTTPROUTE, route[1], route[0])))
    ctx.say(f"HTTPRoute {'/'.join(route)}: {want} for Gateway {'/'.join(gateway)}")


def route_must_be_accepted_and_resolved(ctx: Context, route: NN, gateway: NN) -> None:
    route_must_have_condition(ctx, route, gateway, "Accepted", "True")
    route_must_have_condition(ctx, route, gateway, "ResolvedRefs", "True")


# --- InferencePool -------------------------------------------------------------------------------------------

def pool_must_have_condition(ctx: Context, pool: NN, gateway: NN, type_: str, status: str,
                             reason: str | None = None) -> None:
    pool_must_have_one_of(ctx, pool, gateway, [(type_, status, reason)])


def pool_must_have_one_of(ctx: Context, pool: NN, gateway: NN,
                          allowed: list[tuple[str, str, str | None]]) -> None:
    """The pool's status.parents entry for `gateway` has one of the (type, status, reason) conditions."""
    def holds() -> bool:
        obj = ctx.cluster.get(res.POOL, pool[1], pool[0])
        conds = conditions_of(parent_entry(obj, gateway[0], gateway[1]))
        return any((c := conds.get(t)) and c.get("status") == s and r in (None, c.get("reason"))
                   for t, s, r in allowed)

    want = " or ".join(f"{t}={s}" + (f" ({r})" if r else "") for t, s, r in allowed)
    wait_until(holds, ctx.timing.condition_s, f"InferencePool {'/'.join(pool)} to have {want} for Gateway "
               f"{'/'.join(gateway)}", describe=lambda: _status_text(ctx.cluster.get(res.POOL, pool[1], pool[0])))
    ctx.say(f"InferencePool {'/'.join(pool)}: {want} for Gateway {'/'.join(gateway)}")


def pool_must_be_accepted_by(ctx: Context, pool: NN, gateway: NN) -> None:
    pool_must_have_condition(ctx, pool, gateway, "Accepted", "True")


def pool_must_have_no_parents(ctx: Context, pool: NN) -> None:
    wait_until(lambda: not ((ctx.cluster.get(res.POOL, pool[1], pool[0]) or {}).get("status") or {}).get("parents"),
               ctx.timing.condition_s, f"InferencePool {'/'.join(pool)} to have no status.parents",
               describe=lambda: _status_text(ctx.cluster.get(res.POOL, pool[1], pool[0])))
    ctx.say(f"InferencePool {'/'.join(pool)}: no parents")


# --- pods ----------------------------------------------------------------------------------------------------

def pods_with_labels(ctx: Context, labels: dict[str, str], count: int) -> list[dict]:
    """Exactly `count` ready pods with `labels` in the app namespace, sorted by name."""
    pods = wait_until(lambda: (p if len(p := ctx.cluster.ready_pods(res.APP_BACKEND_NS, labels)) == count else None),
                      ctx.timing.pods_ready_s, f"{count} ready pods with labels {labels}",
                      describe=lambda: str([q["metadata"]["name"] for q in ctx.cluster.ready_pods(
                          res.APP_BACKEND_NS, labels)]))
    return sorted(pods, key=lambda p: p["metadata"]["name"])


# --- traffic -------------------------------------------------------------------------------------------------

def response_check(statuses: tuple[int, ...] = (200,), backend: str | None = None,
                   namespace: str | None = res.APP_BACKEND_NS, headers: dict[str, str] | None = None):
    """A check for Gateway.expect_eventually: status in `statuses`; for 2xx, the echo came from a pod whose
    name starts with `backend`, in `namespace`, and the response has `headers`."""
    def check(r: Response) -> bool:
        if r.status not in statuses:
            raise AssertionError(f"status {r.status}, want one of {list(statuses)}")
        if not 200 <= r.status < 300:
            return True
        if backend and not r.pod.startswith(backend):
            raise AssertionError(f"served by pod {r.pod!r}, want a pod named {backend}*")
        if namespace and r.namespace != namespace:
            raise AssertionError(f"served from namespace {r.namespace!r}, want {namespace!r}")
        for k, v in (headers or {}).items():
            if r.header(k) != v:
                raise AssertionError(f"response header {k}={r.header(k)!r}, want {v!r}")
        return True
    return check


def expect(ctx: Context, gateway: NN, req: Request, statuses: tuple[int, ...] = (200,), backend: str | None = None,
           namespace: str | None = res.APP_BACKEND_NS, headers: dict[str, str] | None = None) -> Response:
    """Send `req` to `gateway` until the answer is as stated for `consecutive_successes` answers in a row."""
    check = response_check(statuses, backend, namespace, headers)
    resp = ctx.gateway(gateway).expect_eventually(req, check, timeout_s=ctx.timing.traffic_s,
                                                  consecutive=ctx.timing.consecutive_successes,
                                                  what=f"HTTP {'/'.join(map(str, statuses))}"
                                                       + (f" from {backend}*" if backend else ""))
    ctx.say(f"{req.method} {req.host}{req.path} -> {resp.describe()}")
    return resp


def send_many(ctx: Context, gateway: NN, req: Request, total: int, concurrency: int) -> list[Response]:
    """`total` requests, `concurrency` at a time; a transport error fails the test."""
    gw = ctx.gateway(gateway)

    def one(_):
        try:
            return gw.send(req)
        except Exception as exc:  # noqa: BLE001 - reported with the request
            raise ConformanceError(f"{req.method} {req.host}{req.path}: request failed: {exc}") from exc

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(one, range(total)))


def traffic_only_reaches(ctx: Context, gateway: NN, req: Request, pod_names: list[str], backend: str,
                         total: int = 100, concurrency: int = 10) -> list[Response]:
    """Every one of `total` concurrent requests answers 200 from one of `pod_names` (upstream: 100 / 10)."""
    check = response_check((200,), backend)
    responses = send_many(ctx, gateway, req, total, concurrency)
    for r in responses:
        check(r)
        if r.pod not in pod_names:
            raise ConformanceError(f"request was handled by an unexpected pod {r.pod!r} (expected one of {pod_names})")
    ctx.say(f"{total} requests reached only {sorted({r.pod for r in responses})}")
    return responses
