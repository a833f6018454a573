"""EPP micro-benchmarks (wired into `kvgate bench epp`): scheduling latency (scrape cost: `kvgate bench scrape`).

bench_scheduling   Scheduler.schedule + on_picked per request with upstream's default scorers, over synthetic
                   endpoints with random metrics, every one holding a hot 4 KB prompt prefix (the prefix index's
                   worst case); per-plugin times from the framework's timers.
bench_prefix_match PrefixIndex.match_runs over a grid of endpoint counts × prompt blocks.
"""

from __future__ import annotations

import random
import statistics
import time

from kvgate.epp.types import Endpoint, EndpointMetrics, EndpointState, LLMRequest


def _percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def synthetic_endpoints(num_endpoints: int, rng: random.Random) -> list[EndpointState]:
    now = time.monotonic()
    states = []
    for i in range(num_endpoints):
        address = f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}:8000"
        metrics = EndpointMetrics(waiting_queue_size=rng.randint(0, 8), running_requests=rng.randint(0, 64),
                                  kv_cache_usage=rng.random(), kv_block_size=16, num_kv_blocks=28672,
                                  updated_at=now)
        states.append(EndpointState(Endpoint(address), metrics, stale=False,
                                    in_flight_requests=rng.randint(0, 32), in_flight_tokens=rng.randint(0, 50000)))
    return states


def synthetic_prompts(num_requests: int, rng: random.Random, num_prefixes: int = 16) -> list[str]:
    """2-8 KB prompts: one of `num_prefixes` shared system prompts (1.5-6 KB) plus a unique question."""
    words = [f"w{n}" for n in range(2000)]

    def text(size: int) -> str:
        out, length = [], 0
        while length < size:
            w = rng.choice(words)
            out.append(w)
            length += len(w) + 1
        return " ".join(out)[:size]

    prefixes = [text(rng.randint(1500, 6000)) for _ in range(num_prefixes)]
    return [rng.choice(prefixes) + "\nUser: " + text(rng.randint(500, 2000)) for _ in range(num_requests)]


HOT_PREFIX_CHARS = 4096  # 64 index blocks of 64 characters (16-token KV blocks × 4)


def _summary(samples_us: list[float]) -> dict:
    samples_us = sorted(samples_us)
    return {"p50_us": _percentile(samples_us, 0.50), "p99_us": _percentile(samples_us, 0.99),
            "mean_us": statistics.fmean(samples_us)}


def bench_scheduling(num_endpoints: int, num_requests: int, seed: int = 0) -> dict:
    """Decision time (schedule + on_picked, one CycleState) with a hot shared prefix every endpoint holds.

    The worst case for the prefix index: every request's first 64 blocks are held by all endpoints, the rest
    (500-2000 characters) by none. Reported, in microseconds:
      p50/p99/mean         the decision over one endpoint snapshot reused across requests (a scrape round)
      untimed_p50_us       the same with plugin timing off: the cost of the framework's per-plugin timers
      fresh_states_p50_us  new EndpointState objects every request (datalayer.states() per request): the
                           per-snapshot caches miss, every column is recomputed
      live_load_p50_us     the reused snapshot with the director's live in-flight overlay (scheduling/live_load.py),
                           every pick recorded in it: the herd fix's cost (queue-scorer renormalizes per request)
      full_index_p50_us    after filling the prefix index to its default memory budget
      plugins              per-plugin p50 (µs) by extension point
    """
    from kvgate.epp.scheduling.config import default_config
    from kvgate.epp.scheduling.framework import CycleState, Scheduler
    from kvgate.epp.scheduling.live_load import LoadTracker

    rng = random.Random(seed)
    scheduler = Scheduler(default_config().scheduler)  # upstream's: queue 2, kv-cache 2, prefix 3, one endpoint
    endpoints = synthetic_endpoints(num_endpoints, rng)
    hot = synthetic_prompts(1, rng, num_prefixes=1)[0][:HOT_PREFIX_CHARS]
    for i, e in enumerate(endpoints):  # every endpoint holds the hot prefix
        scheduler.on_picked(LLMRequest(f"warm-{i}", "demo", "demo", hot), e)
    questions = [p[-rng.randint(500, 2000):] for p in synthetic_prompts(num_requests, rng, num_prefixes=1)]

    def decide(tag: str, states_for, tracker: LoadTracker | None = None) -> list[float]:
        samples = []
        for i, question in enumerate(questions):
            request = LLMRequest(request_id=f"{tag}-{i}", model="demo", target_model="demo", prompt=hot + question)
            states = states_for()
            t0 = time.perf_counter_ns()
            cycle = CycleState(tracker.view(states) if tracker is not None else None)
            ordered = scheduler.schedule(request, states, cycle)
            scheduler.on_picked(request, ordered[0], cycle)
            if tracker is not None:  # as the director records the pick
                tracker.add(request, ordered[0].address, request.estimated_prompt_tokens, 100)
            samples.append((time.perf_counter_ns() - t0) / 1000)
        return samples

    scheduler.timings.reset()
    timed = _summary(decide("timed", lambda: endpoints))
    plugin_means = {f"{point}/{name}": 1e6 * seconds / calls
                    for (point, _, name), (calls, seconds) in scheduler.plugin_timings().items()}
    scheduler.timings.enabled = False
    untimed = _summary(decide("untimed", lambda: endpoints))
    fresh = _summary(decide("fresh", lambda: [EndpointState(e.endpoint, e.metrics, e.stale, e.in_flight_requests,
                                                            e.in_flight_tokens) for e in endpoints]))
    live = _summary(decide("live", lambda: endpoints, LoadTracker()))
    scheduler.timings.enabled = True
    per_plugin: dict[str, list[float]] = {}
    scheduler.timings.observer = lambda point, _type, name, s: per_plugin.setdefault(f"{point}/{name}",
                                                                                      []).append(s * 1e6)
    decide("observed", lambda: endpoints)
    scheduler.timings.observer = None
    prefix = scheduler.plugins_of_type("prefix-cache-scorer")[0]
    # Then with the index full (its default 256 MiB budget reached with 64-block chains spread over all
    # endpoints): the same work on dicts far larger than the CPU caches, plus eviction on every pick.
    index = prefix.index
    room = min(index.max_entries, sum(prefix.capacity_for(e) for e in endpoints)) - index.size()
    for i in range(max(0, room) // 64):  # bounded: one 64-block chain per step, round robin
        e = endpoints[i % num_endpoints]
        index.add([rng.getrandbits(64) for _ in range(64)], e.address, prefix.capacity_for(e))
    full = _summary(decide("full", lambda: endpoints))
    return {
        "num_endpoints": num_endpoints,
        "num_requests": num_requests,
        **timed,
        "untimed_p50_us": untimed["p50_us"],
        "fresh_states_p50_us": fresh["p50_us"],
        "fresh_states_p99_us": fresh["p99_us"],
        "live_load_p50_us": live["p50_us"],
        "live_load_p99_us": live["p99_us"],
        "full_index_p50_us": full["p50_us"],
        "full_index_p99_us": full["p99_us"],
        "full_index_entries": index.size(),
        "plugins_p50_us": {k: _percentile(sorted(v), 0.5) for k, v in per_plugin.items()},
        "plugins_mean_us": plugin_means,
        "prefix_hit_ratio": prefix.hit_ratio(),
    }


def bench_prefix_match(endpoint_counts=(10, 100, 1000), block_counts=(16, 64, 256), repeats: int = 100) -> dict:
    """PrefixIndex.match_runs vs the per-block holder-set intersection it replaced, when every endpoint holds
    the prompt (plus 16 unique blocks nobody holds): µs per match, best of 3 × `repeats`, keyed "ExB".

    The baseline grows with endpoints × blocks; match_runs stays flat: it walks from the deepest block and stops
    at the first block every holder of block 0 holds, one bitset operation."""
    from kvgate.epp.prefix.approx_index import PrefixIndex
    from kvgate.epp.prefix.hashing import hash_prompt

    rng = random.Random(1)
    prompt = synthetic_prompts(1, rng, num_prefixes=1)[0] * 8
    out: dict[str, dict[str, float]] = {}
    for blocks in block_counts:
        hashes = hash_prompt(prompt, "demo", None, 64, blocks)
        assert len(hashes) == blocks, "the synthetic prompt is too short"
        for count in endpoint_counts:
            index = PrefixIndex(capacity_per_server=10 * blocks)
            holders: dict[int, set[str]] = {}
            for i in range(count):
                address = f"10.0.{i // 256}.{i % 256}:8000"
                index.add(hashes, address)
                for h in hashes:
                    holders.setdefault(h, set()).add(address)
            request_hashes = hashes + [rng.getrandbits(64) for _ in range(16)]
            new = min(timeit_ns(lambda: index.match_runs(request_hashes), repeats) for _ in range(3)) / 1000
            old = min(timeit_ns(lambda: _intersection_match(holders, request_hashes), repeats)
                      for _ in range(3)) / 1000
            out[f"{count}x{blocks}"] = {"match_us": new, "set_intersection_us": old}
    return out


def _intersection_match(holders: dict[int, set[str]], hashes: list[int]) -> dict[str, int]:
    """Set intersection block by block, the simple form of the prefix match, kept only as this bench's baseline."""
    if not hashes or hashes[0] not in holders:
        return {}
    matched: dict[str, int] = {}
    alive = set(holders[hashes[0]])
    for i in range(1, len(hashes)):
        found = holders.get(hashes[i])
        still = alive & found if found else set()
        if len(still) != len(alive):
            for address in alive - still:
                matched[address] = i
            if not still:
                return matched
        alive = still
    for address in alive:
        matched[address] = len(hashes)
    return matched


def timeit_ns(fn, repeats: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(repeats):
        fn()
    return (time.perf_counter_ns() - t0) / repeats


# ------------------------------------------------------------------------------------------ scrape CPU
