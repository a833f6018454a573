"""One cell of `kvgate bench routing`: a routing configuration at one request rate on one workload.

Each cell gets a fresh stack (launch_local_stack: new sim replicas, EPP, Envoy), so every configuration
starts with cold engine caches and a cold EPP index: the engines have no prefix-cache reset endpoint, and a
restart also clears what the EPP learnt. The replicas sit on their own loopback addresses (127.0.0.2, ...), as
pods would, so engines publishing KV events share one port pair. The identical arrival sequence (workloads.py)
is sent open-loop: each request at its time, whatever the others are doing, streamed through bench/chaos/load.py's
checking client. Requests still running `drain_s` after the last arrival are cancelled and count as failed.

The prefix-cache hit rate and the per-replica load come from the engines' own counters, scraped before and
after (vllm:prefix_cache_hits / vllm:prefix_cache_queries in tokens; vllm:request_success per replica). The EPP's
own time per routed request comes from its histograms, scraped the same way (`epp_time`: the decision alone, and
the whole request path in the EPP — body parse, slow plugin work, decision), since on a slower CPU that time is
what a lead is lost to.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from kvgate.bench.routing import oracle, pinning
from kvgate.bench.routing.configurations import (SIM_MODEL, RoutingConfig, router_program, slow_replica_args,
                                                  sim_engine_args)
from kvgate.bench.routing.workloads import BenchRequest, WorkloadShape
from kvgate.bench.chaos.load import Outcome, StreamLoad
from kvgate.common.epp_protocol import TEST_ENDPOINT_SELECTION_HEADER, TTFT_OBJECTIVE_HEADER
from kvgate.common.processes import free_port
from kvgate.stack.local_stack import LocalStack, StackSpec, launch_local_stack
from kvgate.stack.supervisor import Stack

COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:request_success")
# The EPP's histograms of its own time per request, and their names in the result file.
EPP_HISTOGRAMS = {"kvgate_epp_scheduling_duration_seconds": "decision",
                  "kvgate_epp_request_path_duration_seconds": "request_path"}


def engine_counters(endpoint: str) -> dict[str, float]:
    """The engine's own cumulative counters (summed over labels)."""
    text = httpx.get(f"http://{endpoint}/metrics", timeout=5).text
    out = dict.fromkeys(COUNTERS, 0.0)
    for family in text_string_to_metric_families(text):
        if family.name in out:
            out[family.name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return out


def engine_latency_models(endpoints: list[str]) -> dict | None:
    """The latency model each kvgate engine fitted from its own requests (engine/server/latency_fit.py), read off its
    page: per endpoint the TTFTs fitted and the p50 / p90 of the model's relative error over its last 1000
    predictions, and those quantiles averaged over the endpoints weighed by their predictions. None when no engine
    has predicted yet (not kvgate engines, or too few requests)."""
    per: dict[str, dict] = {}
    for e in endpoints:
        text = httpx.get(f"http://{e}/metrics", timeout=5).text
        row: dict = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "kvgate:latency_model_observations_total" and sample.labels.get("kind") == "ttft":
                    row["observations"] = int(sample.value)
                elif sample.name == "kvgate:ttft_model_relative_error":
                    row[f"p{round(100 * float(sample.labels['quantile']))}"] = round(sample.value, 4)
        if "p50" in row:
            per[e] = row
    if not per:
        return None
    weights = [max(r.get("observations", 0), 1) for r in per.values()]
    mean = {q: round(sum(w * r[q] for w, r in zip(weights, per.values()) if q in r) / sum(weights), 4)
            for q in ("p50", "p90")}
    return {"endpoints": per, **mean}


def all_counters(endpoints: list[str]) -> dict[str, dict[str, float]]:
    """engine_counters of every endpoint, by endpoint."""
    return {e: engine_counters(e) for e in endpoints}


def hit_rate(before: dict[str, dict], after: dict[str, dict]) -> float | None:
    """The engines' prefix-cache hits ÷ queries (tokens) between two all_counters scrapes."""
    queries = sum(after[e]["vllm:prefix_cache_queries"] - before[e]["vllm:prefix_cache_queries"] for e in after)
    hits = sum(after[e]["vllm:prefix_cache_hits"] - before[e]["vllm:prefix_cache_hits"] for e in after)
    return round(hits / queries, 4) if queries else None


def epp_metrics(metrics_port: int) -> list:
    """The EPP's metric families, one scrape."""
    return list(text_string_to_metric_families(httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text))


def epp_kv_event_counts(metrics_port: int) -> dict[str, int]:
    """The EPP's KV-event counters (kvgate_epp_kv_events{event}: batches, gaps, replays_failed, restarts, ...):
    whether its precise index kept up with the engines during the run."""
    return kv_event_counts(epp_metrics(metrics_port))


def kv_event_counts(families: list) -> dict[str, int]:
    """epp_kv_event_counts of an epp_metrics scrape."""
    return {s.labels["event"]: int(s.value) for family in families
            if family.name == "kvgate_epp_kv_events" for s in family.samples if s.name.endswith("_total")}


def prefill_rates(families: list) -> dict[str, float]:
    """The EPP's online prefill-rate estimate per endpoint (tokens/s; endpoints not yet measured left out): what
    the speed-aware load signals (loadUnit: seconds) divide by."""
    return {s.labels["endpoint"]: round(s.value, 1) for family in families
            if family.name == "kvgate_epp_endpoint_prefill_tokens_per_second" for s in family.samples}


_LATENCY_SUMS = {"kvgate_epp_latency_prediction_abs_error_seconds": "error",
                 "kvgate_epp_latency_measured_seconds": "measured"}


def affinity_spills(families: list, name: str = "kvgate_epp_affinity_spills") -> int | None:
    """The requests the affinity filter spilled to a cold endpoint (spillShare; with `name`
    kvgate_epp_affinity_spills_without_room, those it kept because no copy fitted); None when the EPP runs no such
    filter."""
    for family in families:
        if family.name == name:
            return int(sum(s.value for s in family.samples if s.name.endswith("_total")))
    return None


def second_homes(families: list) -> dict[str, int] | None:
    """The affinity filter's second homes (secondHome latency) by event — opened, declined, lapsed, evicted; None
    when the EPP runs no such filter."""
    for family in families:
        if family.name == "kvgate_epp_affinity_second_homes":
            return {s.labels["event"]: int(s.value) for s in family.samples if s.name.endswith("_total")}
    return None


def latency_model(families: list) -> dict | None:
    """predicted-latency-scorer's model as the EPP exports it: per kind (ttft, tpot) the responses it learned from,
    its mean relative error (sum |predicted - measured| / sum measured) and the p50 / p90 of the per-request
    relative error over its last 1000; and the objectives counts. None when the EPP runs no such scorer."""
    values: dict[str, dict] = {}
    found = False
    for family in families:
        for s in family.samples:
            if family.name == "kvgate_epp_latency_observations" and s.name.endswith("_total"):
                values.setdefault(s.labels["kind"], {})["observations"] = int(s.value)
                found = True
            elif family.name in _LATENCY_SUMS and s.name.endswith("_total"):
                values.setdefault(s.labels["kind"], {})[_LATENCY_SUMS[family.name]] = s.value
            elif family.name == "kvgate_epp_latency_relative_error":
                values.setdefault(s.labels["kind"], {})[f"p{s.labels['quantile'][2:]}"] = round(s.value, 4)
            elif family.name == "kvgate_epp_latency_objectives" and s.name.endswith("_total"):
                values.setdefault("objectives", {})[s.labels["result"]] = int(s.value)
    if not found:
        return None
    for kind in ("ttft", "tpot"):
        v = values.get(kind, {})
        error, measured = v.pop("error", None), v.pop("measured", None)
        if error is not None and measured:
            v["relative_error"] = round(error / measured, 4)
    return values


def epp_histograms(families: list) -> dict[str, dict]:
    """The EPP's decision and request-path histograms: {name: {"count", "sum", "buckets": {le: cumulative}}}."""
    out: dict[str, dict] = {}
    for family in families:
        if family.name not in EPP_HISTOGRAMS:
            continue
        h = out.setdefault(family.name, {"count": 0.0, "sum": 0.0, "buckets": {}})
        for s in family.samples:
            if s.name.endswith("_count"):
                h["count"] = s.value
            elif s.name.endswith("_sum"):
                h["sum"] = s.value
            elif s.name.endswith("_bucket"):
                h["buckets"][float(s.labels["le"])] = s.value
    return out


def epp_time(before: dict[str, dict], after: dict[str, dict]) -> dict:
    """Per histogram, what the cell added: calls, mean and p99 (the bucket bound it falls in), milliseconds."""
    out = {}
    for name, key in EPP_HISTOGRAMS.items():
        a, b = after.get(name), before.get(name, {"count": 0.0, "sum": 0.0, "buckets": {}})
        if a is None:
            continue
        n = a["count"] - b["count"]
        if n <= 0:
            continue
        p99 = next((le for le, c in sorted(a["buckets"].items()) if c - b["buckets"].get(le, 0.0) >= 0.99 * n),
                   float("inf"))
        out[key] = {"requests": int(n), "mean_ms": round(1000 * (a["sum"] - b["sum"]) / n, 3),
                    "p99_ms_at_most": round(1000 * p99, 3) if p99 != float("inf") else None}
    return out


def _start(workdir: Path, config: RoutingConfig, replicas: int, startup_timeout: float,
           engine_args: list[str], epp_replicas: int = 1, epp_peer_sync: bool = True,
           epp_peer_sync_insecure: bool = False, engine_args_for: Callable[[int, str], list[str]] | None = None) -> tuple[LocalStack, str]:
    """The stack for `config`, and the URL the load goes to."""
    stack = Stack(Path(tempfile.mkdtemp(prefix=f"{config.name}-", dir=workdir)))
    flavor = "kvgate" if config.kind == "epp" else "round-robin"  # a router brings its own load balancing
    try:
        up = launch_local_stack(stack, StackSpec(
            replicas=replicas, model=SIM_MODEL, backend="sim", host="127.0.0.1", port=free_port(),
            epp_config_text=config.epp_config, engine_args=engine_args, envoy_flavor=flavor,
            engine_hosts=[f"127.0.0.{2 + i}" for i in range(replicas)], kv_events=config.kv_events,
            startup_timeout=startup_timeout, epp_replicas=epp_replicas if config.kind == "epp" else 1,
            epp_peer_sync=epp_peer_sync, epp_peer_sync_insecure=epp_peer_sync_insecure,
            engine_args_for=engine_args_for))
        url = up.url
        if config.kind == "router":
            port = free_port()
            program, *policy = config.router_cmd
            stack.start("router", [router_program(program), *policy, "--host", "127.0.0.1", "--port", str(port),
                                   "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                                   "--worker-urls", *[f"http://{e}" for e in up.endpoints]])
            url = f"http://127.0.0.1:{port}"
            _wait_serving(stack, url, time.monotonic() + startup_timeout)
        return up, url
    except BaseException:
        stack.stop()
        raise


def _wait_serving(stack: Stack, url: str, deadline: float) -> None:
    """Until a one-token completion through `url` succeeds (a router first health-checks its workers)."""
    def ok() -> bool:
        try:
            return httpx.post(url + "/v1/completions", json={"model": SIM_MODEL, "prompt": "ready?",
                                                             "max_tokens": 1}, timeout=5).status_code == 200
        except httpx.HTTPError:
            return False
    stack.wait_until(ok, deadline, f"{url} to serve")


async def _drive(url: str, requests: list[BenchRequest], drain_s: float, tick: Callable[[], None],
                 replicas: list[str] = (), destinations: list[str] | None = None) -> tuple[list[Outcome], float]:
    """Each request at its arrival time, asking its own max_tokens — to `url`, or a foreign one straight to its
    replica of `replicas` (host:port, in order); with `destinations` (oracle-placement), each routed request names
    its endpoint in the conformance header; returns the outcomes in arrival order and the run's start."""
    load = StreamLoad(url, SIM_MODEL, concurrency=1, timeout_s=drain_s + 60)
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=2000)
    start = time.monotonic()
    async with httpx.AsyncClient(timeout=httpx.Timeout(load.timeout_s, connect=10.0), limits=limits) as client:
        async def one(seq: int, r: BenchRequest) -> Outcome:
            await asyncio.sleep(max(0.0, start + r.at - time.monotonic()))
            try:
                headers = {TTFT_OBJECTIVE_HEADER: f"{r.ttft_objective_ms:g}"} if r.ttft_objective_ms > 0 else {}
                if destinations is not None:
                    headers[TEST_ENDPOINT_SELECTION_HEADER] = destinations[seq]
                return await load.one(client, seq, r.prompt,
                                      None if r.foreign is None else f"http://{replicas[r.foreign]}", r.max_tokens,
                                      headers or None)
            finally:
                tick()
        tasks = [asyncio.create_task(one(i, r)) for i, r in enumerate(requests)]
        last = start + (requests[-1].at if requests else 0.0)
        done, pending = await asyncio.wait(tasks, timeout=max(0.0, last - time.monotonic()) + drain_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    for o in load.outcomes:
        if o.ended_at is None or (not o.done and o.error is None and o.status == 200):
            o.error = o.error or f"unfinished {drain_s:g} s after the last arrival"
    # load.outcomes is in send order; the sends happen in arrival order (sleeps to increasing times)
    return load.outcomes, start


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    p = np.percentile(values, [50, 90, 99])
    return {"p50": round(float(p[0]), 4), "p90": round(float(p[1]), 4), "p99": round(float(p[2]), 4)}


def summarize(outcomes: list[Outcome], start: float, before: dict[str, dict], after: dict[str, dict],
              expected: int) -> dict:
    ok = [o for o in outcomes if o.ok()]
    errors: dict[str, int] = {}
    for o in outcomes:
        if not o.ok():
            errors[o.failure_kind()] = errors.get(o.failure_kind(), 0) + 1
    end = max((o.ended_at for o in ok), default=start)
    delta = {e: {k: after[e][k] - before[e][k] for k in COUNTERS} for e in after}
    queries = sum(d["vllm:prefix_cache_queries"] for d in delta.values())
    hits = sum(d["vllm:prefix_cache_hits"] for d in delta.values())
    served = {e: int(d["vllm:request_success"]) for e, d in delta.items()}
    mean = sum(served.values()) / max(1, len(served))
    return {
        "requests": expected, "sent": len(outcomes), "succeeded": len(ok), "failed": len(outcomes) - len(ok),
        "errors": errors,
        "output_tokens_per_s": round(sum(o.tokens for o in ok) / (end - start), 2) if end > start else 0.0,
        "ttft_s": _percentiles([o.first_token_at - o.sent_at for o in ok]),
        "prefix_cache_hit_rate": hit_rate(before, after),
        "prefix_cache_queries": int(queries), "prefix_cache_hits": int(hits),
        "served_per_endpoint": served,  # engine-side, so any router's choice is counted the same way
        "load_spread": round(max(served.values()) / mean, 3) if mean else None,  # busiest / mean; 1.0 = even
        "seconds": round(end - start, 2),
        # what stats.py resamples for the cell's confidence intervals: each succeeded request's TTFT and output
        # tokens, and the span tok/s divides by
        "samples": {"ttft_s": [round(o.first_token_at - o.sent_at, 4) for o in ok], "tokens": [o.tokens for o in ok],
                    "span_s": round(end - start, 4)},
    }


def request_records(outcomes: list[Outcome], requests: list[BenchRequest], start: float) -> list[dict]:
    """One row per request, in arrival order (`--per-request`): when it was sent (s after the start), its prefix key
    (tenant/user or conversation/turn), prompt characters and max_tokens, the engine that served it (its
    x-kvgate-endpoint answer header; None where no answer came), HTTP status, TTFT, the prompt's tokens and how
    many of them the engine had cached (its usage chunk: a tenant's prefix found or lost there), and the failure,
    if any, with the start of what came back (an error body names who answered it: Envoy's or the EPP's text)."""
    rows = []
    for o, r in zip(outcomes, requests):
        ttft = o.first_token_at - o.sent_at if o.first_token_at is not None else None
        rows.append({"sent_s": round(o.sent_at - start, 4), "key": r.key, "prompt_chars": len(r.prompt),
                     "max_tokens": r.max_tokens, "endpoint": o.endpoint, "status": o.status,
                     "ttft_s": None if ttft is None else round(ttft, 4),
                     "prompt_tokens": o.prompt_tokens, "cached_tokens": o.cached_tokens,
                     "failure": None if o.ok() else o.failure_kind(),
                     "error": None if o.ok() else o.error})
    return rows


def objectives_met(outcomes: list[Outcome], requests: list[BenchRequest]) -> dict | None:
    """Of the requests that stated a TTFT objective, how many got their first token within it, measured at the
    client (a failed or shed request did not); the TTFT percentiles of those that stated one and of the others
    (what meeting the objectives cost the rest); None when none stated one."""
    stated = [(o, r.ttft_objective_ms) for o, r in zip(outcomes, requests) if r.ttft_objective_ms > 0]
    if not stated:
        return None
    met = sum(1 for o, ms in stated if o.ok() and (o.first_token_at - o.sent_at) * 1000 <= ms)

    def ttfts(stating: bool) -> list[float]:
        return [o.first_token_at - o.sent_at for o, r in zip(outcomes, requests)
                if o.ok() and (r.ttft_objective_ms > 0) == stating]

    return {"stated": len(stated), "met": met, "share_met": round(met / len(stated), 4),
            "stated_ttft_s": _percentiles(ttfts(True)), "others_ttft_s": _percentiles(ttfts(False))}


def _summed_histograms(up: LocalStack) -> dict[str, dict]:
    """epp_histograms of every EPP replica of the stack, added up."""
    total: dict[str, dict] = {}
    for port in up.epp_metrics_ports:
        for name, h in epp_histograms(epp_metrics(port)).items():
            t = total.setdefault(name, {"count": 0.0, "sum": 0.0, "buckets": {}})
            t["count"] += h["count"]
            t["sum"] += h["sum"]
            for le, c in h["buckets"].items():
                t["buckets"][le] = t["buckets"].get(le, 0.0) + c
    return total


def peer_sync_counts(up: LocalStack) -> dict[str, int]:
    """Active-active replicas' kvgate_epp_peer_sync counters (picks_sent, picks_applied, ...), added up over the
    replicas ({} without peer sync); as of each replica's last heartbeat (0.5 s)."""
    total: dict[str, int] = {}
    for port in up.epp_metrics_ports:
        for family in epp_metrics(port):
            if family.name == "kvgate_epp_peer_sync":
                for s in family.samples:
                    if s.name.endswith("_total"):
                        total[s.labels["event"]] = total.get(s.labels["event"], 0) + int(s.value)
    return total


def _pin(stack, gateway_cpus: frozenset[int]) -> dict:
    """The gateway tier on gateway_cpus, the rest of the stack and this process (the load) on the other CPUs."""
    gateway, rest = pinning.split(gateway_cpus)
    threads = 0
    for child in stack.children:  # each child leads a process group of its own (start_group)
        threads += pinning.pin_group(child.proc.pid, gateway if pinning.is_gateway(child.name) else rest)
    os.sched_setaffinity(0, rest)
    return {"gateway": sorted(gateway), "others": sorted(rest), "threads_pinned": threads}


def cpu_seconds(stack) -> dict[str, float]:
    """CPU seconds so far of each child of the stack (Envoy, every EPP replica, a router, every engine), its whole
    process group."""
    return {child.name: pinning.group_cpu_seconds(child.proc.pid) for child in stack.children}


def cpu_use(before: dict[str, float], after: dict[str, float], requests: int) -> dict:
    """What the stack spent of the CPU while the cell ran: per child; the gateway tier's (Envoy + EPP, or the
    router) and the engines' in all and per request sent. The engines' share counts too: the EPP's scrapes and KV
    events cost the engines CPU that a router without them does not."""
    # a child restarted meanwhile (a new process, its count from 0) is counted from its restart
    seconds = {name: round(used - before.get(name, 0.0) if used >= before.get(name, 0.0) else used, 3)
               for name, used in after.items()}
    gateway = sum(v for name, v in seconds.items() if pinning.is_gateway(name))
    engines = sum(seconds.values()) - gateway

    def per_request(total: float) -> float | None:
        return round(1000 * total / requests, 3) if requests else None

    return {"seconds": seconds, "gateway_s": round(gateway, 3), "engines_s": round(engines, 3),
            "gateway_ms_per_request": per_request(gateway), "engines_ms_per_request": per_request(engines)}


# A stack that does not come up is started once more: free_port() hands out a port that another process on the
# machine may take before Envoy binds it (seen once in a 40-minute --find-saturation run), and one such race
# should not end a sweep.
START_ATTEMPTS = 2


def run_cell(workdir: Path, config: RoutingConfig, shape: WorkloadShape, requests: list[BenchRequest], *,
             replicas: int, drain_s: float, startup_timeout: float = 120.0,
             tick: Callable[[], None] = lambda: None, gateway_cpus: frozenset[int] | None = None,
             epp_replicas: int = 1, epp_peer_sync: bool = True, epp_peer_sync_insecure: bool = False,
             per_request: bool = False) -> dict:
    for attempt in range(START_ATTEMPTS):
        try:
            up, url = _start(workdir, config, replicas, startup_timeout,
                             sim_engine_args(shape.kv_tokens, shape.prefill_chunk), epp_replicas, epp_peer_sync,
                             epp_peer_sync_insecure,
                             slow_replica_args(replicas, shape.slow_replicas, shape.slowdown, shape.slow_kv_tokens))
            break
        except RuntimeError as exc:  # a process exited or never came up: the stack is stopped
            if attempt + 1 == START_ATTEMPTS:
                raise
            print(f"kvgate bench routing: {config.name} did not start ({exc}); once more on fresh ports",
                  file=sys.stderr)
    own_cpus = os.sched_getaffinity(0)
    try:
        cpus = _pin(up.stack, gateway_cpus) if gateway_cpus else None
        # the readiness probe of a router sent one request: counted in `before`, so not in the deltas
        before = all_counters(up.endpoints)
        epp_before = _summed_histograms(up) if config.kind == "epp" else None
        cpu_before = cpu_seconds(up.stack)
        destinations = oracle.placement(requests, up.endpoints) if config.oracle else None
        outcomes, start = asyncio.run(_drive(url, requests, drain_s, tick, up.endpoints, destinations))
        time.sleep(0.2)  # the last requests' counters
        cpu_after = cpu_seconds(up.stack)
        after = all_counters(up.endpoints)
        died = up.stack.dead()
        result = summarize(outcomes, start, before, after, len(requests))
        result["cpu"] = cpu_use(cpu_before, cpu_after, len(requests))
        objectives = objectives_met(outcomes, requests)
        if objectives is not None:
            result["ttft_objectives"] = objectives
        epp_after = epp_metrics(up.metrics_port) if config.kind == "epp" else None  # the first EPP's
        if epp_after is not None:
            result["epp_time"] = epp_time(epp_before, _summed_histograms(up))  # every replica's requests
        if any(r.foreign is not None for r in requests):  # the requests the configuration itself routed
            routed = [o for o, r in zip(outcomes, requests) if r.foreign is None]
            ttfts = [o.first_token_at - o.sent_at for o in routed if o.ok()]
            result["routed"] = {"requests": len(routed), "ttft_s": _percentiles(ttfts),
                                "samples_ttft_s": [round(t, 4) for t in ttfts]}
        result["logs"] = str(up.stack.workdir)
        if per_request:
            result["per_request"] = request_records(outcomes, requests, start)
        if attempt:
            result["start_attempts"] = attempt + 1
        if cpus is not None:
            result["cpus"] = cpus
        if config.kind == "epp" and config.kv_events:
            result["epp_kv_events"] = kv_event_counts(epp_after)
        if epp_after is not None:
            result["epp_prefill_rates"] = prefill_rates(epp_after)
        if config.kind == "epp" and epp_replicas > 1:
            time.sleep(0.6)  # a heartbeat: the replicas publish their peer-sync counts with it
            result["epp_peer_sync"] = peer_sync_counts(up)
        for key, family in (("epp_affinity_spills", "kvgate_epp_affinity_spills"),
                            ("epp_affinity_spills_without_room", "kvgate_epp_affinity_spills_without_room")):
            spills = affinity_spills(epp_after, family) if epp_after is not None else None
            if spills:
                result[key] = spills
        homes = second_homes(epp_after) if epp_after is not None else None
        if homes:
            result["epp_affinity_second_homes"] = homes
        model = latency_model(epp_after) if epp_after is not None else None
        if model is not None:
            result["epp_latency_model"] = model
        engine_models = engine_latency_models(up.endpoints)
        if engine_models is not None:
            result["engine_latency_model"] = engine_models
        if died:
            result["errors"]["a process died"] = 1
            result["died"] = died
        return result
    finally:
        up.stack.stop()
        os.sched_setaffinity(0, own_cpus)
