"""`kvgate bench routing`, shortened, as a user runs it: round-robin and kvgate's approximate EPP on the multi-tenant
workload over real sim replicas, Envoy and the EPP; every request accounted for, the engines' own cache counters
read, and the prefix-aware configuration hitting the cache more than round-robin. Plus the pieces the numbers
rest on: identical request streams per rate, configurations skipped only for a missing plugin or router."""

from __future__ import annotations

import json
import os
import subprocess
from collections import Counter

import pytest
import yaml

from kvgate.bench.routing.configurations import BY_NAME, CONFIGURATIONS, unavailable
from kvgate.bench.routing.report import add_ratios
from kvgate.bench.routing.configurations import SIM_ENGINE_ARGS, sim_engine_args, slow_replica_args
from kvgate.bench.routing.workloads import (DEFAULT_KV_TOKENS, SHAPE_SETS, SHAPES, WORKLOADS, arrivals, parse_shape,
                                            with_foreign)
from kvgate.epp.scheduling.config import parse_config
from kvgate.epp.scheduling.plugins import REGISTRY
from tests.procs import KVGATE


def test_same_prompts_in_the_same_order_at_every_rate():
    for shape in WORKLOADS.values():
        slow, fast = arrivals(shape, 2.0, 10.0, seed=3), arrivals(shape, 8.0, 10.0, seed=3)
        assert len(fast) > 2 * len(slow) > 0
        assert [r.prompt for r in slow] == [r.prompt for r in fast[:len(slow)]]
        assert all(a.at < b.at for a, b in zip(fast, fast[1:])) and fast[-1].at <= 10.0
        assert arrivals(shape, 8.0, 10.0, seed=4)[0].prompt != fast[0].prompt


def test_workloads_reuse_what_they_say():
    tenant = arrivals(WORKLOADS["multi-tenant"], 10.0, 20.0, seed=0)
    by_tenant: dict[str, set[str]] = {}
    for r in tenant:
        by_tenant.setdefault(r.key.split("/")[0], set()).add(r.prompt[:2000])
    assert all(len(systems) == 1 for systems in by_tenant.values()) and len(by_tenant) == 12
    chat = arrivals(WORKLOADS["multi-turn"], 10.0, 20.0, seed=0)
    last: dict[str, str] = {}
    for r in chat:
        conv, turn = r.key.split("/")
        if turn != "turn0":
            assert r.prompt.startswith(last[conv]) and len(r.prompt) > len(last[conv])
        last[conv] = r.prompt
    no_reuse = arrivals(WORKLOADS["no-reuse"], 10.0, 20.0, seed=0)
    assert len({r.prompt[:64] for r in no_reuse}) == len(no_reuse)


def test_foreign_traffic_is_the_same_for_every_configuration_and_prefix_affine():
    requests = arrivals(WORKLOADS["multi-tenant"], 20.0, 30.0, seed=2)
    assert with_foreign(requests, 0.0, 4, seed=2) is requests
    foreign = with_foreign(requests, 0.3, 4, seed=2)
    assert foreign == with_foreign(requests, 0.3, 4, seed=2)  # drawn by the seed: every configuration gets it
    assert [(r.at, r.prompt) for r in foreign] == [(r.at, r.prompt) for r in requests]
    share = sum(r.foreign is not None for r in foreign) / len(foreign)
    assert 0.22 < share < 0.38, share
    by_tenant = {}
    for r in foreign:
        if r.foreign is not None:  # the foreign gateway hashes the tenant's system prompt: one replica a tenant
            by_tenant.setdefault(r.key.split("/")[0], set()).add(r.foreign)
    assert all(len(replicas) == 1 for replicas in by_tenant.values()) and len(by_tenant) > 6
    assert {r for replicas in by_tenant.values() for r in replicas} <= {0, 1, 2, 3}


def test_configurations_are_valid_or_wait_for_named_plugins():
    for config in CONFIGURATIONS:
        why = unavailable(config)
        missing = config.plugin_types() - set(REGISTRY)
        if missing:
            assert why and all(m in why for m in missing)
        elif config.kind == "epp":
            assert why is None
            parse_config(config.epp_config)  # what the EPP will be given parses with today's registry
        # Exactly the configurations that read engine KV events get them.
        assert config.kv_events == ("precise-prefix-cache-scorer" in config.plugin_types()), config.name
    assert unavailable(BY_NAME["round-robin"]) is None and unavailable(BY_NAME["approximate"]) is None
    assert yaml.safe_load(BY_NAME["precise"].epp_config)["kind"] == "EndpointPickerConfig"


def test_ratios_are_against_the_same_rate():
    def cell(name, rate, tps, p90):
        return {"configuration": name, "rate": rate, "output_tokens_per_s": tps, "ttft_s": {"p90": p90}}
    cells = [cell("round-robin", 2, 100, 1.0), cell("approximate", 2, 150, 0.5), cell("round-robin", 6, 50, 4.0),
             cell("approximate", 6, 200, 1.0), cell("vllm-router", 6, 100, 2.0), cell("sglang-router", 6, 80, 1.6)]
    add_ratios(cells)
    assert cells[1]["vs_round_robin"] == {"output_tokens_per_s": 1.5, "ttft_p90": 0.5}
    assert cells[3]["vs_round_robin"] == {"output_tokens_per_s": 4.0, "ttft_p90": 0.25}
    assert cells[3]["vs_best_router"] == {"output_tokens_per_s": 2.0, "ttft_p90": 0.625}
    assert "vs_best_router" not in cells[1]


SHORT_SHAPE = "multi-tenant:output_spread=0.5"


@pytest.mark.processes
@pytest.mark.slow
def test_short_run_end_to_end(tmp_path):
    result_file = tmp_path / "routing.json"
    # multi-tenant's prompts with spread output lengths: each request must get exactly its own max_tokens
    # With two CPUs or more, the gateway tier runs pinned to one of them (--gateway-cpus), the rest on the others.
    cpus = sorted(os.sched_getaffinity(0))
    pin = ["--gateway-cpus", str(cpus[0])] if len(cpus) >= 2 else []
    run = subprocess.run([KVGATE, "bench", "routing", "--short", "--workloads", SHORT_SHAPE,
                          "--configs", "round-robin,approximate", "--foreign-share", "0.1", "--epp-replicas", "1,2",
                          "--result-file", str(result_file), "--per-request", *pin],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and result_file.exists(), run.stdout + run.stderr[-3000:]
    result = json.loads(result_file.read_text())
    assert set(result["configurations"]) == {"round-robin", "approximate"}
    workload = result["workloads"][SHORT_SHAPE]
    assert workload["knobs"]["output_spread"] == 0.5 and workload["knobs"]["kind"] == "multi-tenant"
    cells = {c["configuration"]: c for c in workload["cells"]}
    # the EPP configuration once per --epp-replicas count: two EPPs serving at once behind Envoy as approximate-x2
    assert set(cells) == {"round-robin", "approximate", "approximate-x2"} and result["epp_replicas"] == [1, 2]
    assert cells["approximate-x2"]["epp_replicas"] == 2 and "epp_replicas" not in cells["round-robin"]
    requests = with_foreign(arrivals(parse_shape(SHORT_SHAPE), 6.0, 6.0, seed=0), 0.1, 4, seed=0)
    assert len({r.max_tokens for r in requests}) > 5
    expected = len(requests)
    routed = sum(r.foreign is None for r in requests)
    assert 0 < routed < expected  # some went through the foreign gateway, straight to a replica
    for name, c in cells.items():
        assert c["requests"] == c["sent"] == c["succeeded"] == expected and c["failed"] == 0, (name, c)
        assert c["routed"]["requests"] == routed and c["routed"]["ttft_s"]["p90"] > 0, c
        assert sum(c["served_per_endpoint"].values()) == expected and len(c["served_per_endpoint"]) == 4, c
        assert c["output_tokens_per_s"] > 0 and 0 < c["ttft_s"]["p50"] <= c["ttft_s"]["p90"] <= c["ttft_s"]["p99"]
        # --per-request: a row per request, in arrival order, each naming the engine that served it (the engine's
        # own answer header, through Envoy or straight): they add up to the engines' own success counters
        rows = c["per_request"]
        assert [r["key"] for r in rows] == [r.key for r in requests]
        assert all(r["failure"] is r["error"] is None for r in rows)
        assert Counter(r["endpoint"] for r in rows) == Counter(c["served_per_endpoint"]), (name, rows[:3])
        ttfts = sorted(r["ttft_s"] for r in rows)
        assert abs(ttfts[len(ttfts) // 2] - c["ttft_s"]["p50"]) < 0.01, (name, c["ttft_s"])
        # each row's prompt and cached tokens are the engine's usage: they add up to its prefix-cache counters
        assert all(0 <= r["cached_tokens"] <= r["prompt_tokens"] for r in rows), rows[:3]
        assert sum(r["prompt_tokens"] for r in rows) == c["prefix_cache_queries"], name
        assert sum(r["cached_tokens"] for r in rows) == c["prefix_cache_hits"], name
        # every prompt token was a cache query, on the engines' own counters
        assert c["prefix_cache_queries"] >= expected * 2300 and 0 <= c["prefix_cache_hit_rate"] <= 1, c
    # The prefix scorer keeps each tenant on one replica: judged against the hit rate that placement gives (every
    # request after a tenant's first reuses its system prompt), not against round-robin's, which depends on how
    # Envoy's workers happened to interleave (5% here, 28% in a CI run). Measured: 0.47-0.52 of a 0.53 ceiling.
    tenants = Counter(r.key.split("/")[0] for r in requests)
    shape = WORKLOADS["multi-tenant"]
    ceiling = sum(n - 1 for n in tenants.values()) * shape.system_len / sum(len(r.prompt) for r in requests)
    approximate = cells["approximate"]["prefix_cache_hit_rate"]
    round_robin = cells["round-robin"]["prefix_cache_hit_rate"]
    assert approximate >= 0.7 * ceiling and approximate > round_robin, (approximate, round_robin, ceiling)
    assert cells["approximate"]["vs_round_robin"]["output_tokens_per_s"] is not None
    # the EPP's own time per request: every request it routed (both replicas' together), the decision inside the
    # request path
    for name in ("approximate", "approximate-x2"):
        epp = cells[name]["epp_time"]
        assert epp["decision"]["requests"] == epp["request_path"]["requests"] == routed, (name, epp)
    # the two replicas shared their picks (epp/peer_sync.py): each applied the other's, none malformed
    sync = cells["approximate-x2"]["epp_peer_sync"]
    assert sync["picks_sent"] == routed and sync["picks_applied"] >= 0.9 * routed, sync
    assert sync["bad_messages"] == sync["foreign_endpoint"] == 0, sync
    assert "epp_peer_sync" not in cells["approximate"]
    epp = cells["approximate"]["epp_time"]
    assert 0 < epp["decision"]["mean_ms"] <= epp["request_path"]["mean_ms"] <= epp["request_path"]["p99_ms_at_most"]
    assert "epp_time" not in cells["round-robin"]
    # the EPP's prefill-rate estimates, per endpoint it has measured (the sim: 0.2 ms a prompt token, ≤ 5000/s)
    rates = cells["approximate"]["epp_prefill_rates"]
    assert set(rates) <= set(cells["approximate"]["served_per_endpoint"]), rates
    assert all(0 < r < 10_000 for r in rates.values()), rates
    if pin:
        assert result["gateway_cpus"] == [cpus[0]]
        for c in cells.values():  # Envoy (+ the EPP) on the first CPU, the engines on the others
            assert c["cpus"]["gateway"] == [cpus[0]] and c["cpus"]["others"] == cpus[1:], c["cpus"]
            assert c["cpus"]["threads_pinned"] > 10, c["cpus"]
    assert "multi-tenant" in run.stdout and "round-robin" in run.stdout and "routed p90" in run.stdout
    assert "EPP ms/req" in run.stdout
    # --short runs each cell once, on --seed's stream: its interval is over that run's requests, and says so
    assert result["repeats"] == 1 and result["repeat_seeds"] == [0]
    for name, c in cells.items():
        assert c["ci"]["method"] == "within-run" and c["ci"]["runs"] == 1 and "runs" not in c, name
        lo, hi = c["ci"]["ttft_s"]["p90"]
        assert lo <= c["ttft_s"]["p90"] <= hi, (name, c["ci"])
        assert len(c["samples"]["ttft_s"]) == len(c["samples"]["tokens"]) == c["succeeded"], name
        assert sum(c["samples"]["tokens"]) / c["samples"]["span_s"] == pytest.approx(c["output_tokens_per_s"], rel=0.01)
    assert f"{cells['round-robin']['ttft_s']['p90']:.2f} [" in run.stdout and "within its one run" in run.stdout


def test_base_workloads_send_the_streams_they_always_sent():
    """The knobs left at their defaults change nothing: the three base workloads' requests (times, prompts, keys)
    hash as they did before the knobs existed (seed 5, 12/s, 20 s), every request asking the shape's output_len."""
    import hashlib

    expected = {"multi-tenant": "d2a8fcd6ea5a73da", "multi-turn": "4340520407a9ad7c", "no-reuse": "bee2f78a82316884"}
    for name, digest in expected.items():
        reqs = arrivals(WORKLOADS[name], 12.0, 20.0, seed=5)
        got = hashlib.sha256(json.dumps([(round(r.at, 9), r.prompt, r.key) for r in reqs]).encode()).hexdigest()
        assert got[:16] == digest and len(reqs) == 248, name
        assert {r.max_tokens for r in reqs} == {32}


def test_held_out_4_sends_the_streams_it_was_frozen_with():
    """held-out-4 was chosen and frozen before any routing change ran on it: its shapes' requests (times, prompts,
    keys, max_tokens; seed 5, 12/s, 20 s) hash as they did when it was frozen, and fit the replicas' context."""
    import hashlib

    expected = {"agent-sessions": "78fd3dbf5b4378af", "shifting-tenants": "67544bed56442122",
                "user-documents": "9b51b73b39c8974a"}
    assert SHAPE_SETS["held-out-4"] == tuple(expected)
    for name, digest in expected.items():
        reqs = arrivals(SHAPES[name], 12.0, 20.0, seed=5)
        got = hashlib.sha256(json.dumps([(round(r.at, 9), r.prompt, r.key) for r in reqs]).encode()).hexdigest()
        assert got[:16] == digest and len(reqs) == 248, name
        assert max(len(r.prompt) + r.max_tokens for r in reqs) <= SHAPES[name].context_tokens(), name


def test_a_rotating_popularity_moves_the_hot_tenant_every_n_requests():
    shape = parse_shape("multi-tenant:tenants=6,tenant_skew=2,skew_rotate_every=50")
    reqs = arrivals(shape, 50.0, 20.0, seed=1)
    assert len(reqs) >= 600
    for phase in range(len(reqs) // 50):
        asked = Counter(r.key.split("/")[0] for r in reqs[50 * phase:50 * (phase + 1)])
        hottest, coldest = f"t{phase % 6}", f"t{(phase - 1) % 6}"  # the hottest moves on; last one's goes coldest
        assert asked.most_common(1)[0][0] == hottest and asked[hottest] > 25, (phase, asked)
        assert asked[coldest] <= 3, (phase, asked)
    # the same draws as without rotation, each tenant moved on by its phase: prompts and users as before
    still = arrivals(parse_shape("multi-tenant:tenants=6,tenant_skew=2"), 50.0, 20.0, seed=1)
    for i, (a, b) in enumerate(zip(reqs, still)):
        t = int(b.key.split("/")[0][1:])
        assert a.key == f"t{(t + i // 50) % 6}/{b.key.split('/')[1]}"
    with pytest.raises(ValueError, match="skew_rotate_every"):
        parse_shape("multi-tenant:skew_rotate_every=-1")


@pytest.mark.slow
def test_knobs_do_what_they_say():
    import numpy as np

    bursty = arrivals(SHAPES["bursty-tenants"], 50.0, 200.0, seed=1)
    gaps = np.diff([r.at for r in bursty])
    assert 2.6 < gaps.std() / gaps.mean() < 3.4 and abs(len(bursty) / 200.0 - 50.0) < 8   # same mean rate
    poisson = np.diff([r.at for r in arrivals(WORKLOADS["multi-tenant"], 50.0, 200.0, seed=1)])
    assert 0.9 < poisson.std() / poisson.mean() < 1.1
    hot = arrivals(SHAPES["hot-tenant"], 50.0, 100.0, seed=1)
    first = sum(r.key.startswith("t0/") for r in hot) / len(hot)
    weights = [1 / (i + 1) ** 1.2 for i in range(12)]
    assert abs(first - weights[0] / sum(weights)) < 0.04, first
    mixed = arrivals(SHAPES["mixed-lengths"], 50.0, 100.0, seed=1)
    lengths, outputs = [len(r.prompt) for r in mixed], [r.max_tokens for r in mixed]
    assert abs(np.mean(lengths) / 1200 - 1) < 0.1 and min(lengths) >= 300 and max(lengths) <= 4800
    assert abs(np.mean(outputs) / 64 - 1) < 0.1 and len(set(outputs)) > 20
    # the prompts do not depend on the output knobs: long-output sends multi-tenant's prompts
    assert [r.prompt for r in arrivals(SHAPES["long-output"], 6.0, 10.0, 2)] == \
        [r.prompt for r in arrivals(WORKLOADS["multi-tenant"], 6.0, 10.0, 2)]


def test_shape_sets_and_command_line_shapes():
    held_outs = ("held-out", "held-out-2", "held-out-3", "held-out-4")
    for held_out in held_outs:  # judged on, never tuned on
        assert not set(SHAPE_SETS[held_out]) & set(SHAPE_SETS["tuning"])
        assert not set(SHAPE_SETS[held_out]) & {s for other in held_outs if other != held_out
                                                for s in SHAPE_SETS[other]}
    assert all(name in SHAPES for names in SHAPE_SETS.values() for name in names)
    custom = parse_shape("multi-tenant:tenants=32,burstiness=2.5,kv_tokens=4096")
    assert (custom.tenants, custom.burstiness, custom.kv_tokens, custom.generator) == (32, 2.5, 4096, "multi-tenant")
    assert parse_shape("small-kv:kv_tokens=2048").kv_tokens == 2048 and parse_shape("deep-chat") is SHAPES["deep-chat"]
    for bad, says in (("nope", "unknown workload"), ("multi-tenant:tenants", "knob=value"),
                      ("multi-tenant:colour=3", "knob=value"), ("no-reuse:prompt_len=x", "needs a number"),
                      ("multi-tenant:burstiness=0", "burstiness > 0"), ("no-reuse:slowdown=0.5", "slowdown"),
                      ("no-reuse:slow_replicas=-1", "slow_replicas"), ("no-reuse:slow_kv_tokens=100", "slow_kv")):
        with pytest.raises(ValueError, match=says):
            parse_shape(bad)
    assert sim_engine_args(4096)[sim_engine_args(4096).index("--kv-cache-memory") + 1] == str(4096 * 131072)
    assert sim_engine_args(DEFAULT_KV_TOKENS) == SIM_ENGINE_ARGS
    # mixed hardware: the last slow_replicas engines get --sim-slowdown
    mixed = SHAPES["mixed-speed"]
    args_for = slow_replica_args(4, mixed.slow_replicas, mixed.slowdown)
    assert [args_for(i, "h") for i in range(4)] == [[], [], ["--sim-slowdown", "2"], ["--sim-slowdown", "2"]]
    assert slow_replica_args(4, 0, 1.0)(3, "h") == [] and slow_replica_args(2, 4, 3.0)(0, "h") != []
    generations = SHAPES["mixed-generations"]  # older cards: slower and with half the KV
    slow = slow_replica_args(4, generations.slow_replicas, generations.slowdown, generations.slow_kv_tokens)(3, "h")
    assert slow[:2] == ["--sim-slowdown", "2"] and slow[2:] == sim_engine_args(4096)
    assert generations.context_tokens() == 4096 and SHAPES["mixed-speed"].context_tokens() == 8192


def _outcome(ttft_s: float, ok: bool = True):
    """A streamed answer whose first token came `ttft_s` after it was sent (failed unless `ok`)."""
    from kvgate.bench.chaos.load import Outcome

    o = Outcome(sent_at=10.0, max_tokens=1)
    o.status, o.first_token_at, o.ended_at, o.tokens, o.usage_tokens, o.done = 200, 10.0 + ttft_s, 11.0, 1, 1, ok
    return o


def test_a_ttft_objective_knob_goes_with_every_request_and_is_judged_at_the_client():
    from kvgate.bench.routing.runner import objectives_met

    shape = parse_shape("multi-tenant:ttft_objective_ms=500")
    requests = arrivals(shape, 4, 2, 0)
    assert requests and {r.ttft_objective_ms for r in requests} == {500.0}
    assert {r.ttft_objective_ms for r in arrivals(WORKLOADS["multi-tenant"], 4, 2, 0)} == {0.0}
    with pytest.raises(ValueError, match="TTFT objective"):
        parse_shape("multi-tenant:ttft_objective_ms=-1")

    got = objectives_met([_outcome(0.2), _outcome(0.7), _outcome(0.1, ok=False)], requests[:3])
    assert {k: got[k] for k in ("stated", "met", "share_met")} == {"stated": 3, "met": 1, "share_met": 0.3333}
    assert got["stated_ttft_s"]["p50"] == pytest.approx(0.45) and got["others_ttft_s"]["p50"] is None
    assert objectives_met([_outcome(0.2)], arrivals(WORKLOADS["multi-tenant"], 4, 2, 0)[:1]) is None


def test_a_share_of_the_requests_states_the_objective_the_same_ones_for_every_configuration():
    from kvgate.bench.routing.runner import objectives_met

    shape = parse_shape("multi-tenant:ttft_objective_ms=300,objective_share=0.25")
    requests = arrivals(shape, 10, 20, 0)
    stating = [r.ttft_objective_ms > 0 for r in requests]
    assert 0.15 < sum(stating) / len(requests) < 0.35 and {r.ttft_objective_ms for r in requests} == {0.0, 300.0}
    assert stating == [r.ttft_objective_ms > 0 for r in arrivals(shape, 10, 20, 0)]  # drawn by the seed
    with pytest.raises(ValueError, match="objective_share"):
        parse_shape("multi-tenant:ttft_objective_ms=300,objective_share=1.5")

    got = objectives_met([_outcome(0.2 if s else 0.9) for s in stating], requests)
    assert got["stated"] == got["met"] == sum(stating)
    assert got["stated_ttft_s"]["p90"] == pytest.approx(0.2) and got["others_ttft_s"]["p90"] == pytest.approx(0.9)


def test_a_per_request_row_keeps_what_a_failed_request_got_back():
    from kvgate.bench.routing.runner import request_records
    from kvgate.bench.chaos.load import Outcome

    requests = arrivals(WORKLOADS["multi-tenant"], 4, 2, 0)[:2]
    served = Outcome(sent_at=1.0, max_tokens=requests[0].max_tokens, status=200, first_token_at=1.25, ended_at=2.0,
                     endpoint="127.0.0.1:1", tokens=requests[0].max_tokens, usage_tokens=requests[0].max_tokens,
                     done=True)
    refused = Outcome(sent_at=1.5, max_tokens=requests[1].max_tokens, status=503, ended_at=1.6,
                      error="upstream connect error or disconnect/reset before headers")
    rows = request_records([served, refused], requests, start=1.0)
    assert rows[0]["failure"] is rows[0]["error"] is None and rows[0]["ttft_s"] == 0.25
    assert rows[1]["failure"] == "HTTP 503" and rows[1]["error"].startswith("upstream connect error")
    assert rows[1]["ttft_s"] is None and rows[1]["endpoint"] is None


def test_oracle_placement_deals_the_groups_out_in_a_snake():
    from kvgate.bench.routing.oracle import placement, snake
    from kvgate.bench.routing.workloads import BenchRequest

    assert [snake(i, 4) for i in range(10)] == [0, 1, 2, 3, 3, 2, 1, 0, 0, 1]
    keys = ["t0/u0"] * 5 + ["t1/u1"] * 4 + ["t2/u0"] * 3 + ["r7", "t3/u0", "t3/u1", "r8"] + ["t4/u0"] * 2
    requests = [BenchRequest(i / 10, "p", k) for i, k in enumerate(keys)]
    got = placement(requests, ["b:1", "a:1", "c:1"])  # ranks t0 t1 t2 t3 t4 → a b c c b; one-offs in turn
    want = {"t0": "a:1", "t1": "b:1", "t2": "c:1", "t3": "c:1", "t4": "b:1"}
    assert [g for k, g in zip(keys, got) if not k.startswith("r")] == [want[k.split("/")[0]] for k in keys
                                                                       if not k.startswith("r")]
    assert [g for k, g in zip(keys, got) if k.startswith("r")] == ["a:1", "b:1"]
    with pytest.raises(ValueError):
        placement(requests, [])


@pytest.mark.processes
def test_oracle_placement_reaches_the_engines_through_envoy_and_the_epp(tmp_path):
    """Each tenant's requests are served by the one replica its rank gives (the engines' own answer header)."""
    result_file = tmp_path / "oracle.json"
    run = subprocess.run([KVGATE, "bench", "routing", "--workloads", "multi-tenant", "--configs", "oracle-placement",
                          "--rates", "6", "--duration", "3", "--drain", "20", "--repeats", "1", "--per-request",
                          "--result-file", str(result_file)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and result_file.exists(), run.stdout + run.stderr[-3000:]
    (cell,) = json.loads(result_file.read_text())["workloads"]["multi-tenant"]["cells"]
    assert cell["failed"] == 0, cell["errors"]
    served: dict[str, set] = {}
    for row in cell["per_request"]:
        served.setdefault(row["key"].split("/")[0], set()).add(row["endpoint"])
    assert all(len(endpoints) == 1 for endpoints in served.values()), served
    repeated = [t for t, n in Counter(r["key"].split("/")[0] for r in cell["per_request"]).items() if n > 1]
    by_replica = Counter(next(iter(served[t])) for t in repeated)
    assert max(by_replica.values()) - min(by_replica.values()) <= 1, by_replica  # as many groups each (snake)
