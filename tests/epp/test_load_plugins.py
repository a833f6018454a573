"""Load-aware plugins: their math, the prefix match they read and how a config links it, and the prefill-rate
estimate."""

import dataclasses
import math
import time

import numpy as np
import pytest

from kvgate.epp.datalayer.dialects import DIALECTS
from kvgate.epp.datalayer.exposition import parse_metrics
from kvgate.epp.datalayer.prefill_rate import MIN_BUSY_S, PrefillRateEstimator
from kvgate.epp.scheduling.config import ConfigError, parse_config
from kvgate.epp.scheduling.framework import CycleState, Filter, Scheduler
from kvgate.epp.scheduling.data import PICKED_UNCACHED_TOKENS
from kvgate.epp.scheduling.live_load import LoadTracker
from kvgate.epp.scheduling.plugins import create_plugin
from kvgate.epp.scheduling.plugins.predicted_ttft_scorer import PredictedTTFTScorer
from kvgate.epp.scheduling.prefix_match import PREFIX_MATCH
from kvgate.epp.types import Endpoint, EndpointMetrics, EndpointState, LLMRequest
from tests.epp.helpers import state

HEAD = "You are a careful assistant. " * 9  # 261 characters: 4 full 64-character blocks + 5
PROMPT = (HEAD + "Tell me about the tides, the moon and the sea, " * 9)[:640]  # 10 blocks of 64 = 160 tokens


def config(*plugins: str, profile: list[str] | None = None) -> str:
    """An EndpointPickerConfig: `plugins` are YAML list items; the profile lists pluginRefs (all by default)."""
    text = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n"
    text += "".join(f"- {p}\n" for p in plugins)
    if profile is not None:
        text += "schedulingProfiles:\n- name: default\n  plugins:\n"
        text += "".join(f"  - pluginRef: {r}\n" for r in profile)
    return text


def warmed(scheduler: Scheduler, states, holds: dict[str, str]) -> None:
    """Each address in `holds` has been sent its prompt (the prefix index learns it)."""
    by_address = {s.address: s for s in states}
    for address, prompt in holds.items():
        scheduler.on_picked(LLMRequest(f"warm-{address}", "m", "m", prompt), by_address[address])


def req(prompt=PROMPT, rid="r1", max_tokens=None):
    return LLMRequest(rid, "m", "m", prompt, max_tokens=max_tokens)


# -------------------------------------------------------------------------------- the prefix match, linked

def test_the_approximate_prefix_scorer_produces_the_prefix_match_from_one_hashing():
    scheduler = Scheduler(parse_config(config("type: prefix-cache-scorer")).scheduler)
    scorer = scheduler.plugins_of_type("prefix-cache-scorer")[0]
    assert scorer.produces == (PREFIX_MATCH,)
    states = [state("a:1"), state("b:1"), state("c:1")]
    warmed(scheduler, states, {"a:1": PROMPT, "b:1": PROMPT[:256] + "x" * 384})
    calls = []
    real = scorer.hashes
    scorer.hashes = lambda *a: calls.append(1) or real(*a)
    cycle = CycleState()
    scorer.produce(req(), states, cycle)
    match = cycle[PREFIX_MATCH, "prefix-cache-scorer"]
    assert match.prompt_tokens == 160
    assert list(match.cached.of(states)) == [160, 64, 0]  # 10 and 4 blocks of 16 tokens
    assert list(match.cached.of([states[1]])) == [64]  # any list of the candidates
    assert list(scorer.score(req(), states, cycle)) == [1.0, 0.4, 0.0]  # the score it always gave
    scheduler.on_picked(req(), states[2], cycle)
    assert len(calls) == 1  # the prefix match, the score and the pick hook shared one hashing
    assert list(scorer.score(req(rid="r2"), states, CycleState())) == [1.0, 0.4, 1.0]


@pytest.mark.parametrize("plugin", ["prefix-cache-affinity-filter", "no-hit-lru-scorer", "predicted-ttft-scorer"])
def test_a_prefix_match_producer_is_checked_when_the_config_loads(plugin):
    with pytest.raises(ConfigError, match=f"'{plugin}' reads prefix-match from 'nope', which is not a plugin of this "
                                          "profile that produces it"):
        parse_config(config("type: prefix-cache-scorer", f"type: {plugin}\n  parameters: {{prefixScorer: nope}}"))
    two = ("type: prefix-cache-scorer\n  name: p1", "type: prefix-cache-scorer\n  name: p2")
    with pytest.raises(ConfigError, match=f"schedulingProfiles.*'{plugin}' reads prefix-match, which several "
                                          "plugins of this profile produce .p1, p2.: name one with the consumer's "
                                          "prefixScorer"):
        parse_config(config(*two, f"type: {plugin}"))
    named = parse_config(config(*two, f"type: {plugin}\n  parameters: {{prefixScorer: p2}}"))
    assert named.scheduler.plugins[plugin].inputs[PREFIX_MATCH] == "p2"
    alone = parse_config(config(f"type: {plugin}"))  # no prefix scorer: nothing counts as cached
    assert PREFIX_MATCH not in alone.scheduler.plugins[plugin].inputs
    # a producer outside the profile is not this profile's
    with pytest.raises(ConfigError, match="reads prefix-match from 'p1'"):
        parse_config(config(*two, f"type: {plugin}\n  parameters: {{prefixScorer: p1}}", profile=["p2", plugin]))


@pytest.mark.parametrize("plugin, params, message", [
    ("prefix-cache-affinity-filter", "{affinityThreshold: 0}", "affinityThreshold must be in (0, 1]"),
    ("prefix-cache-affinity-filter", "{affinityThreshold: 1.5}", "affinityThreshold must be in (0, 1]"),
    ("prefix-cache-affinity-filter", "{explorationProbability: -0.1}", "explorationProbability"),
    ("prefix-cache-affinity-filter", "{loadTolerance: .nan}", "loadTolerance must be in"),
    ("prefix-cache-affinity-filter", "{maxTTFTPenaltyMs: 5}", "unknown parameter"),
    ("no-hit-lru-scorer", "{lruSize: 0}", "lruSize must be >= 1"),
    ("no-hit-lru-scorer", "{prefixPluginName: 3}", "prefixPluginName must be a string"),
    ("predicted-ttft-scorer", "{defaultPrefillTokensPerSecond: 0}", "defaultPrefillTokensPerSecond"),
    ("predicted-ttft-scorer", "{decodeMsPerRunningRequest: true}", "must be a number"),
    ("token-load-scorer", "{x: 1}", "unknown parameter"),
])
def test_bad_parameters_are_named(plugin, params, message):
    with pytest.raises(ConfigError, match=f"\\({plugin}\\).*{message.replace('(', '.').replace(']', '.')}"):
        parse_config(config(f"type: {plugin}\n  parameters: {params}"))


# -------------------------------------------------------------------------------- prefix-cache-affinity-filter

def affinity(threshold=0.8, tolerance=1.0):
    text = config("type: prefix-cache-scorer", "type: prefix-cache-affinity-filter\n  parameters: "
                  f"{{affinityThreshold: {threshold}, loadTolerance: {tolerance}, explorationProbability: 0}}")
    scheduler = Scheduler(parse_config(text).scheduler)
    states = [state("a:1"), state("b:1"), state("c:1")]
    warmed(scheduler, states, {"a:1": PROMPT, "b:1": PROMPT[:256] + "x" * 384})  # cached 160, 64, 0 of 160
    return scheduler, scheduler.plugins_of_type("prefix-cache-affinity-filter")[0], states


def loads(states, tokens: dict[str, int]) -> CycleState:
    tracker = LoadTracker()
    cycle = CycleState(tracker.view(states))
    for address, n in tokens.items():
        tracker.add(LLMRequest(f"load-{address}", "m", "m", ""), address, tokens=n, prompt_tokens=0)
    return cycle


def cycle_for(scheduler: Scheduler, request: LLMRequest, states, tokens: dict[str, int] | None = None) -> CycleState:
    """A cycle as the scheduler starts one for `request`: `tokens` in flight per address (loads), and the data the
    profile's plugins read, produced over `states`."""
    return produced(scheduler, request, states, loads(states, tokens or {}))


def decide(scheduler: Scheduler, step, request: LLMRequest, states, tokens: dict[str, int] | None = None):
    """step(request, states, cycle) — a plugin's filter, score or predict — in a cycle as the scheduler starts one
    for `request` (cycle_for)."""
    return step(request, states, cycle_for(scheduler, request, states, tokens))


def produced(scheduler: Scheduler, request: LLMRequest, states, cycle: CycleState) -> CycleState:
    """`cycle` with the data the profile's plugins read for `request`, produced over `states`."""
    scheduler.primary.produce(request, states, cycle)
    return cycle


def addresses(states):
    return [s.address for s in states]


def test_affinity_keeps_warm_endpoints_until_their_load_exceeds_the_saved_prefill():
    scheduler, f, states = affinity()
    assert addresses(decide(scheduler, f.filter, req(), states)) == ["a:1"]
    # w* = a (cached 160), c* = the least loaded cold endpoint; saved = 160 - cached(c*)
    # c* = c (0 cached, no load): saved 160; a may carry 160 tokens more than c
    assert addresses(decide(scheduler, f.filter, req(), states, {"a:1": 160, "b:1": 500})) == ["a:1"]
    assert decide(scheduler, f.filter, req(), states, {"a:1": 161, "b:1": 500}) is states  # all kept, same list
    # c* = b (64 cached, least loaded): saved 96
    assert addresses(decide(scheduler, f.filter, req(), states, {"a:1": 196, "b:1": 100, "c:1": 101})) == ["a:1"]
    assert decide(scheduler, f.filter, req(), states, {"a:1": 197, "b:1": 100, "c:1": 101}) is states


def test_affinity_threshold_tolerance_and_never_empty():
    scheduler, f, states = affinity(threshold=0.4)  # b (64/160 = 0.4) is warm too
    assert addresses(decide(scheduler, f.filter, req(), states, {"a:1": 10})) == ["a:1", "b:1"]
    scheduler, f, states = affinity(tolerance=0)  # any extra load on the warm side breaks stickiness
    assert decide(scheduler, f.filter, req(), states, {"a:1": 1}) is states
    assert addresses(decide(scheduler, f.filter, req(), states)) == ["a:1"]
    scheduler, f, states = affinity(tolerance=1e6)
    assert addresses(decide(scheduler, f.filter, req(), states, {"a:1": 10**6})) == ["a:1"]
    cold = req("nothing like it " * 40)
    assert decide(scheduler, f.filter, cold, states) is states  # no warm endpoint: keep all
    assert decide(scheduler, f.filter, req(), states[:1]) == states[:1]


def test_affinity_is_a_preference_the_cold_endpoints_follow_as_fallbacks():
    """With a picker returning fallbacks, the endpoints the affinity filter dropped come after the warm one
    (ranked by the scorers), so a gateway that retries has somewhere to go if the warm endpoint is dead; with
    one endpoint returned (a stock gateway) only the warm one; a hard filter after it still binds the fallbacks."""
    def scheduler_with(picker: str, *hard: Filter):
        text = config("type: prefix-cache-scorer", "type: prefix-cache-affinity-filter\n  parameters: "
                      "{explorationProbability: 0}", "type: queue-scorer", picker,
                      profile=["prefix-cache-affinity-filter", "prefix-cache-scorer", "queue-scorer",
                               picker.split("\n")[0].removeprefix("type: ")])
        scheduler = Scheduler(parse_config(text).scheduler)
        scheduler.primary.filters += hard
        return scheduler

    states = [state("a:1"), state("b:1", queue=5), state("c:1")]
    three = scheduler_with("type: max-score-picker\n  parameters: {maxNumOfEndpoints: 3}")
    warmed(three, states, {"a:1": PROMPT, "b:1": PROMPT[:256] + "x" * 384})  # cached 160, 64, 0 of 160
    cycle = CycleState()
    assert addresses(three.schedule(req(), states, cycle)) == ["a:1", "c:1", "b:1"]  # warm, then by queue
    assert cycle.snapshot is not None and addresses(cycle.snapshot.endpoints) == ["a:1"]  # the primary's

    one = scheduler_with("type: max-score-picker")
    warmed(one, states, {"a:1": PROMPT})
    assert addresses(one.schedule(req(), states, CycleState())) == ["a:1"]

    class NotC(Filter):
        def filter(self, request, endpoints, cycle=None):
            return [e for e in endpoints if e.address != "c:1"]

    hard = scheduler_with("type: max-score-picker\n  parameters: {maxNumOfEndpoints: 3}", NotC())
    warmed(hard, states, {"a:1": PROMPT})
    assert addresses(hard.schedule(req(), states, CycleState())) == ["a:1", "b:1"]


def test_affinity_exploration_keeps_all_for_about_its_share_of_requests():
    scheduler = Scheduler(parse_config(config("type: prefix-cache-scorer", "type: prefix-cache-affinity-filter\n"
                                              "  parameters: {explorationProbability: 0.25}")).scheduler)
    f = scheduler.plugins_of_type("prefix-cache-affinity-filter")[0]
    states = [state("a:1"), state("b:1")]
    warmed(scheduler, states, {"a:1": PROMPT})
    kept_all = sum(len(decide(scheduler, f.filter, req(rid=f"r{i}"), states)) == 2 for i in range(2000))
    assert 400 < kept_all < 600  # 25% ± 5 standard deviations
    again = [len(decide(scheduler, f.filter, req(rid="r7"), states)) for _ in range(2)]
    assert again[0] == again[1]


def test_affinity_on_the_prefill_backlog_counts_only_uncached_work():
    """kvgate engines export their prefill backlog: a warm endpoint's many mostly-cached requests cost it little,
    so it stays warm where in-flight tokens would have broken stickiness."""
    pending = {"a:1": 96, "b:1": 0, "c:1": 0}  # scraped kvgate:num_prefill_tokens_pending
    states = [ttft_state(a, pending=p) for a, p in pending.items()]
    scheduler, f, _ = affinity()
    warmed(scheduler, states, {"a:1": PROMPT, "b:1": PROMPT[:256] + "x" * 384})
    heavy_in_flight = {"a:1": 10_000}  # 10k tokens in flight to a (prompt + max_tokens, mostly cached)
    # c* = b (no backlog, 64 cached): going to a saves 96 prefill tokens, and a's backlog is 96
    assert addresses(decide(scheduler, f.filter, req(), states, heavy_in_flight)) == ["a:1"]
    states[0].metrics.prefill_tokens_pending = 97  # more backlog than the hit saves
    assert decide(scheduler, f.filter, req(), states) is states
    tokens = create_plugin("prefix-cache-affinity-filter", {"loadSignal": "tokens", "explorationProbability": 0})
    tokens.inputs = dict(f.inputs)  # reads the profile's prefix match
    states[0].metrics.prefill_tokens_pending = 0
    assert decide(scheduler, tokens.filter, req(), states, heavy_in_flight) is states  # the old signal lets go


def test_the_backlog_less_what_the_running_step_computed_by_the_scrape():
    m = EndpointMetrics(prefill_tokens_pending=3000, prefill_tokens_awaiting_step=500, step_age_s=0.1,
                        prefill_tokens_per_s=10_000)
    assert m.prefill_backlog == 3000 - 1000  # 0.1 s of a step at 10k tokens/s
    m.step_age_s = 0.5
    assert m.prefill_backlog == 500  # never below what awaits a step: the running step cannot be computing that
    m.prefill_tokens_awaiting_step = 3000
    assert m.prefill_backlog == 3000
    m.prefill_tokens_awaiting_step = 0
    assert m.prefill_backlog == 0
    for unknown in ({"step_age_s": None}, {"prefill_tokens_awaiting_step": None}, {"prefill_tokens_per_s": None}):
        assert dataclasses.replace(m, **unknown).prefill_backlog == 3000  # not exported, or no rate: as scraped
    assert EndpointMetrics().prefill_backlog is None


def test_affinity_and_predicted_ttft_see_the_running_steps_progress():
    """A warm endpoint mid-way through a long step counts only the part of its backlog still to compute."""
    scheduler, f, _ = affinity()
    states = [ttft_state("a:1", pending=250, rate=1000), ttft_state("b:1", pending=0, rate=1000),
              ttft_state("c:1", pending=0, rate=1000)]
    warmed(scheduler, states, {"a:1": PROMPT, "b:1": PROMPT[:256] + "x" * 384})  # saved going to a over b: 96
    assert decide(scheduler, f.filter, req(), states) is states  # 250 > 96: all kept
    for s in states:
        s.metrics.prefill_tokens_awaiting_step, s.metrics.step_age_s = 0, 0.0
    states[0].metrics.step_age_s = 0.16  # 160 of a's 250 tokens computed by the scrape: 90 left
    assert addresses(decide(scheduler, f.filter, req(), states)) == ["a:1"]
    ttft = PredictedTTFTScorer(default_prefill_tokens_per_s=1000, decode_ms_per_running_request=0)
    ttft.inputs = dict(f.inputs)
    assert decide(scheduler, ttft.predict, req(), states)[0] == pytest.approx(0.09)  # (250 - 160 + 0 uncached) / 1000


def test_affinity_backlog_adds_the_uncached_tokens_routed_since_the_scrape():
    scheduler, f, _ = affinity()
    states = [ttft_state(a, pending=0) for a in ("a:1", "b:1", "c:1")]
    tracker = LoadTracker()  # a holds all 160 tokens of the prompt, b 64 (affinity()'s warm-up), c none
    tracker.add(LLMRequest("since", "m", "m", ""), "a:1", tokens=5000, prompt_tokens=90)  # uncached part: 90
    cycle = produced(scheduler, req(), states, CycleState(tracker.view(states)))
    assert addresses(f.filter(req(), states, cycle)) == ["a:1"]  # 90 ≤ 96 saved over b
    tracker.add(LLMRequest("since-2", "m", "m", ""), "a:1", tokens=5000, prompt_tokens=7)
    cycle = produced(scheduler, req(), states, CycleState(tracker.view(states)))
    assert f.filter(req(), states, cycle) is states  # 97 > 96


def test_affinity_in_seconds_weighs_each_side_by_its_speed():
    """loadUnit seconds: a pool of mixed hardware. a (warm, 160 of 160 cached) is half as fast as c (cold): its
    backlog costs twice the time, and the prefill c would do costs c's time, not a's."""
    scheduler, _, _ = affinity()
    seconds = create_plugin("prefix-cache-affinity-filter", {"loadSignal": "backlog", "loadUnit": "seconds",
                                                             "explorationProbability": 0})
    seconds.inputs = dict(scheduler.plugins_of_type("prefix-cache-affinity-filter")[0].inputs)
    states = [ttft_state("a:1", pending=0, rate=1000), ttft_state("b:1", pending=10_000, rate=2000),
              ttft_state("c:1", pending=0, rate=2000)]
    # in c's seconds: saved = 160 / 1 (c computes all 160) - 0 / 0.5 = 160; a's backlog counts L / 0.5
    states[0].metrics.prefill_tokens_pending = 80
    assert addresses(decide(scheduler, seconds.filter, req(), states)) == ["a:1"]  # 160 ≤ 160
    states[0].metrics.prefill_tokens_pending = 81
    assert decide(scheduler, seconds.filter, req(), states) is states  # 162 > 160
    tokens = create_plugin("prefix-cache-affinity-filter", {"loadSignal": "backlog", "explorationProbability": 0})
    tokens.inputs = dict(seconds.inputs)
    assert addresses(decide(scheduler, tokens.filter, req(), states)) == ["a:1"]  # in tokens: 81 ≤ 160
    # a uniform pool (rates within the estimate's noise) routes exactly as in tokens
    for s, rate in zip(states, (1900, 2000, 2100)):
        s.metrics.prefill_tokens_per_s = rate
    states[0].metrics.prefill_tokens_pending = 160
    assert addresses(decide(scheduler, seconds.filter, req(), states)) == ["a:1"]
    states[0].metrics.prefill_tokens_pending = 161
    assert decide(scheduler, seconds.filter, req(), states) is states


def test_relative_speed_fills_unmeasured_endpoints_and_ignores_small_differences():
    from kvgate.epp.scheduling.plugins._relative_speed import MIN_SPEED, SAME_SPEED, relative_speed

    def speeds(*rates):
        return list(relative_speed([ttft_state(f"e{i}:1", rate=r) for i, r in enumerate(rates)]))

    assert speeds(None, None) == [1.0, 1.0]  # nothing measured: alike
    assert speeds(4000, 1000, 4000, None) == pytest.approx([1.0, 0.25, 1.0, 1.0])  # unmeasured: the measured median
    assert speeds(1000, 1000 * SAME_SPEED, 1000 * SAME_SPEED - 1) == pytest.approx([1.0, 1.0, SAME_SPEED - 0.001])
    assert speeds(0.0, 500) == [1.0, 1.0]  # a zero rate is no measurement
    assert speeds(1e12, 1000) == [1.0, MIN_SPEED]  # an absurd claim weighs the others ×10 at most


def test_load_scorers_in_seconds_prefer_the_faster_endpoint_for_the_same_tokens():
    states = [ttft_state("a:1", rate=1000), ttft_state("b:1", rate=2000)]
    cycle = loads(states, {"a:1": 300, "b:1": 500})
    by_tokens = create_plugin("token-load-scorer", None)
    by_seconds = create_plugin("token-load-scorer", {"loadUnit": "seconds"})
    assert list(by_tokens.score(req(), states, cycle)) == [1.0, 0.0]
    assert list(by_seconds.score(req(), states, cycle)) == [0.0, 1.0]  # 600 against 500 of b's seconds
    groups = create_plugin("prefix-group-balance-scorer", {"groupChars": 8, "loadUnit": "seconds"})
    groups.pre_request(req("tenant-1 " + "x" * 900), states[0], None)  # ~300 tokens on the slow a
    groups.pre_request(req("tenant-2 " + "x" * 1500), states[1], None)  # ~500 on the fast b
    assert list(groups.score(req("tenant-3 new"), states)) == [0.0, 1.0]
    for plugin in ("token-load-scorer", "prefix-group-balance-scorer", "prefix-cache-affinity-filter"):
        with pytest.raises(ValueError, match="loadUnit must be one of tokens, seconds"):
            create_plugin(plugin, {"loadUnit": "minutes"})


# -------------------------------------------------------------------------------- prefix-group-balance-scorer

def test_group_balance_gives_a_homeless_prefix_to_the_endpoint_with_the_fewest_groups():
    now = [100.0]
    scorer = create_plugin("prefix-group-balance-scorer", {"groupChars": 16, "windowSeconds": 10})
    scorer.clock = lambda: now[0]
    states = [state("a:1"), state("b:1"), state("c:1")]

    def pick(prompt, address):
        scorer.pre_request(req(prompt), states[addresses(states).index(address)], None)

    assert list(scorer.score(req("tenant-1 hello"), states)) == [1.0, 1.0, 1.0]
    pick("tenant-1 system prompt", "a:1")
    pick("tenant-2 system prompt", "a:1")
    pick("tenant-3 system prompt", "b:1")
    assert list(scorer.score(req("tenant-4 system prompt"), states)) == [0.0, 0.5, 1.0]  # groups 2, 1, 0
    # tenant-1's own endpoint counts it already: a (2 - 1) ties b (1); c (0) still best
    assert list(scorer.score(req("tenant-1 system prompt, again"), states)) == [0.0, 0.0, 1.0]
    pick("tenant-1 system prompt", "a:1")  # the same group again: still 2 groups on a, not 3
    assert len(scorer._groups["a:1"]) == 2
    now[0] += 10.5  # the window passed for a and b's groups
    pick("tenant-5 system prompt", "c:1")
    assert list(scorer.score(req("tenant-6 system prompt"), states)) == [1.0, 1.0, 0.0]
    scorer.remove_endpoint("c:1")
    assert list(scorer.score(req("tenant-6 system prompt"), states)) == [1.0, 1.0, 1.0]


def test_group_balance_by_tokens_weighs_each_group_by_its_latest_prompt():
    """balanceBy tokens: a homeless prefix goes where the groups' footprints (their latest prompts' tokens) sum
    least — one long conversation outweighs two short ones, which counting groups would not see."""
    by_tokens = create_plugin("prefix-group-balance-scorer", {"groupChars": 8, "balanceBy": "tokens"})
    by_groups = create_plugin("prefix-group-balance-scorer", {"groupChars": 8})
    states = [state("a:1"), state("b:1")]
    for scorer in (by_tokens, by_groups):
        scorer.pre_request(req("convo-1 " + "x" * 4000), states[0], None)  # ~1000 tokens on a, one group
        scorer.pre_request(req("convo-2 short"), states[1], None)  # two small groups on b
        scorer.pre_request(req("convo-3 short"), states[1], None)
    assert list(by_groups.score(req("convo-4 new"), states)) == [1.0, 0.0]
    assert list(by_tokens.score(req("convo-4 new"), states)) == [0.0, 1.0]
    # a group's footprint is its latest prompt (a conversation grows; it is not counted twice)
    by_tokens.pre_request(req("convo-2 " + "y" * 8000), states[1], None)
    assert list(by_tokens.score(req("convo-4 new"), states)) == [1.0, 0.0]
    # its own group does not count against the endpoint that has it
    assert list(by_tokens.score(req("convo-1 again"), states)) == [1.0, 0.0]
    with pytest.raises(ValueError, match="balanceBy"):
        create_plugin("prefix-group-balance-scorer", {"balanceBy": "bytes"})


def test_group_balance_counts_footprints_as_shares_of_each_endpoints_kv():
    """Mixed hardware: a replica with half the KV cache is given half the groups' footprint (its scraped
    num_kv_blocks × block_size); equal caches, or caches unknown, change nothing."""
    def states(blocks_a, blocks_b):
        return [EndpointState(Endpoint(a), EndpointMetrics(num_kv_blocks=n, kv_block_size=16 if n else None,
                                                           updated_at=time.monotonic()), stale=False)
                for a, n in (("a:1", blocks_a), ("b:1", blocks_b))]

    scorer = create_plugin("prefix-group-balance-scorer", {"groupChars": 8, "balanceBy": "tokens"})
    big_small = states(512, 256)
    scorer.pre_request(req("tenant-1 " + "x" * 4000), big_small[0], None)  # ~1000 tokens on a (8192 tokens of KV)
    scorer.pre_request(req("tenant-2 " + "x" * 2400), big_small[1], None)  # ~600 on b (4096): 1200 of a's scale
    assert list(scorer.score(req("tenant-3 new"), big_small)) == [1.0, 0.0]
    assert list(scorer.score(req("tenant-3 new"), states(512, 512))) == [0.0, 1.0]
    assert list(scorer.score(req("tenant-3 new"), states(None, None))) == [0.0, 1.0]
    scorer.kv_capacity_shares = False  # kvCapacityShares: false
    assert list(scorer.score(req("tenant-3 new"), big_small)) == [0.0, 1.0]


def test_group_balance_in_seconds_weighs_reused_groups_by_kv_and_one_off_prompts_by_speed():
    """loadUnit seconds on a pool of two speeds with equal KV: tenants (groups picked more than once) are a share
    of each replica's cache, which the slow one has as much of; one-off prompts are work, which it does half as
    fast. The form before (every group / min(kv, speed)) gave the fast replica twice the tenants."""
    def pool():
        return [ttft_state("a:1", rate=1000), ttft_state("b:1", rate=2000)]  # a half as fast; KV unknown: alike

    def fill(scorer, states, times):
        for name, e in (("t1", 0), ("t2", 0), ("t3", 1), ("t4", 1), ("t5", 1)):  # ~1000 tokens each: 2 on a, 3 on b
            for _ in range(times):
                scorer.pre_request(req(f"{name}-sys " + "x" * 4000), states[e], None)

    tenants = create_plugin("prefix-group-balance-scorer", {"groupChars": 6, "balanceBy": "tokens",
                                                            "loadUnit": "seconds"})
    fill(tenants, pool(), times=2)
    assert list(tenants.score(req("t6-sys new"), pool())) == [1.0, 0.0]  # 2000 tokens of cache on a, 3000 on b
    one_off = create_plugin("prefix-group-balance-scorer", {"groupChars": 6, "balanceBy": "tokens",
                                                            "loadUnit": "seconds"})
    fill(one_off, pool(), times=1)
    assert list(one_off.score(req("t6-sys new"), pool())) == [0.0, 1.0]  # 2000 tokens of work on a: 4000 of b's
    by_groups = create_plugin("prefix-group-balance-scorer", {"groupChars": 6, "loadUnit": "seconds"})
    fill(by_groups, pool(), times=2)
    assert list(by_groups.score(req("t6-sys new"), pool())) == [1.0, 0.0]  # 2 tenants against 3
    in_tokens = create_plugin("prefix-group-balance-scorer", {"groupChars": 6, "balanceBy": "tokens"})
    fill(in_tokens, pool(), times=1)
    assert list(in_tokens.score(req("t6-sys new"), pool())) == [1.0, 0.0]  # loadUnit tokens: speed not counted


def test_group_balance_token_totals_follow_every_change():
    """The per-endpoint footprint totals (all groups', and those of groups picked there more than once) are kept as
    groups come, grow, come back, expire and overflow: always their sums."""
    import random

    now = [0.0]
    scorer = create_plugin("prefix-group-balance-scorer", {"groupChars": 4, "balanceBy": "tokens",
                                                           "windowSeconds": 5, "maxGroupsPerEndpoint": 6})
    scorer.clock = lambda: now[0]
    states = [state("a:1"), state("b:1")]
    rng = random.Random(7)
    for _ in range(500):
        now[0] += rng.random()
        e = rng.choice(states)
        scorer.pre_request(req(f"g{rng.randrange(12):03d}" + "x" * rng.randrange(4, 400)), e, None)
        scorer.score(req("g999 new"), states)  # expires what the window passed
        for address, groups in scorer._groups.items():
            reused = [tokens for _, tokens, again in groups.values() if again]
            assert scorer._totals[address] == [sum(entry[1] for entry in groups.values()), sum(reused), len(reused)]
            assert len(groups) <= 6


def test_group_balance_memory_is_bounded_per_endpoint():
    """Prompts with no shared prefix each make a group: past maxGroupsPerEndpoint the oldest goes first."""
    scorer = create_plugin("prefix-group-balance-scorer", {"groupChars": 9, "maxGroupsPerEndpoint": 3})
    a = state("a:1")
    for i in range(10):
        scorer.pre_request(req(f"prompt-{i:02d} and the rest"), a, None)
    assert len(scorer._groups["a:1"]) == 3
    assert scorer.group(req("prompt-09 again")) in scorer._groups["a:1"]
    assert scorer.group(req("prompt-00 again")) not in scorer._groups["a:1"]
    with pytest.raises(ValueError, match="maxGroupsPerEndpoint"):
        create_plugin("prefix-group-balance-scorer", {"maxGroupsPerEndpoint": 0})


def test_group_balance_is_neutral_for_a_warm_prompt():
    scheduler = Scheduler(parse_config(config("type: prefix-cache-scorer", "type: prefix-group-balance-scorer",
                                              "type: max-score-picker")).scheduler)
    scorer = scheduler.plugins_of_type("prefix-group-balance-scorer")[0]
    states = [state("a:1"), state("b:1")]
    warmed(scheduler, states, {"a:1": PROMPT})
    assert list(decide(scheduler, scorer.score, req(), states)) == [0.5, 0.5]
    assert list(decide(scheduler, scorer.score, req("something nobody holds " * 20), states)) == [0.0, 1.0]


def test_group_balance_keeps_a_group_whose_prefix_its_home_evicted_at_home():
    """keepHomeBelow: a homeless request whose group's latest pick went to a candidate that now holds less than
    that share of the prompt (its prefix evicted there) scores 1 at that home, 0 elsewhere, however loaded the home;
    a home that still holds most of it (a conversation's next turn) and a group with no home are balanced."""
    scheduler = Scheduler(parse_config(config(
        "type: prefix-cache-scorer", "type: prefix-group-balance-scorer\n  parameters: {groupChars: 8, "
        "keepHomeBelow: 0.5}", "type: max-score-picker")).scheduler)
    scorer = scheduler.plugins_of_type("prefix-group-balance-scorer")[0]
    states = [state("a:1"), state("b:1"), state("c:1")]
    old = "tenant-1" + "x" * 632  # 10 blocks of 64 characters
    warmed(scheduler, states, {"a:1": old})
    for i in range(3):  # a carries three more groups: the balance alone would send tenant-1's next prompt away
        scheduler.on_picked(req(f"other-{i}" + "y" * 300), states[0])
    evicted = old[:192] + "z" * 448  # a holds 3 of its 10 blocks: as if a had evicted the rest
    assert list(decide(scheduler, scorer.score, req(evicted), states)) == [1.0, 0.0, 0.0]
    mostly = old[:384] + "z" * 256  # 6 of 10: not warm (under the affinity threshold), not evicted: balanced
    assert list(decide(scheduler, scorer.score, req(mostly), states)) == [0.0, 1.0, 1.0]
    assert list(decide(scheduler, scorer.score, req("tenant-9" + "z" * 632), states)) == [0.0, 1.0, 1.0]  # no home
    scheduler.on_picked(req(evicted), states[1])  # it went to b after all: b is its home now
    assert list(decide(scheduler, scorer.score, req(old[:64] + "w" * 576), states)) == [0.0, 1.0, 0.0]
    off = create_plugin("prefix-group-balance-scorer", {"groupChars": 8})
    assert off.keep_home_below == 0.0
    with pytest.raises(ValueError, match="keepHomeBelow"):
        create_plugin("prefix-group-balance-scorer", {"keepHomeBelow": 1.5})


def test_group_balance_fit_check_keeps_a_homeless_group_where_its_footprint_still_fits():
    """fitKvCapacity: a homeless request goes only to candidates whose groups' footprints plus its prompt fit their
    KV cache (num_kv_blocks × block_size); its own group's footprint is not counted twice; when none or all fit, or
    a cache is unknown (it fits), nothing is dropped — the very list comes back."""
    def kv_state(address, blocks):
        return EndpointState(Endpoint(address), EndpointMetrics(num_kv_blocks=blocks, kv_block_size=16 if blocks
                                                                else None, updated_at=time.monotonic()), stale=False)

    scorer = create_plugin("prefix-group-balance-scorer", {"groupChars": 8, "balanceBy": "tokens",
                                                           "fitKvCapacity": 1.0})
    a, b, c = kv_state("a:1", 256), kv_state("b:1", 256), kv_state("c:1", 256)  # 4096 tokens each
    for name in ("tenant-1", "tenant-2", "tenant-3"):
        scorer.pre_request(req(name + "x" * 4392), a, None)  # 1100 tokens each: 3300 on a
    scorer.pre_request(req("tenant-4" + "x" * 4392), b, None)  # 1100 on b, nothing on c
    new = req("tenant-5" + "x" * 4392)
    assert addresses(scorer.filter(new, [a, b, c])) == ["b:1", "c:1"]  # 3300 + 1100 > 4096 on a
    assert list(scorer.score(new, [a, b, c])) == pytest.approx([0.0, 2 / 3, 1.0])  # the balance still ranks them
    again = [a, b, c]
    assert scorer.filter(req("tenant-1" + "x" * 4392), again) is again  # a counts tenant-1 already: 3300 fits
    unknown = kv_state("a:1", None)
    assert addresses(scorer.filter(new, [unknown, b])) == ["a:1", "b:1"]
    for name in ("tenant-6", "tenant-7"):
        scorer.pre_request(req(name + "x" * 4392), b, None)
        scorer.pre_request(req(name + "y" * 4392), c, None)
    full = [a, b]
    assert scorer.filter(new, full) is full  # none fits: the balance decides as without the check
    off = create_plugin("prefix-group-balance-scorer", {"groupChars": 8, "balanceBy": "tokens"})
    off.pre_request(req("tenant-1" + "x" * 40000), a, None)
    assert off.filter(new, full) is full
    with pytest.raises(ValueError, match="fitKvCapacity"):
        create_plugin("prefix-group-balance-scorer", {"fitKvCapacity": -1})


def test_kvgates_profile_checks_the_fit_after_the_affinity_filter():
    """In kvgate's profile the fit check runs after the affinity filter (a request it keeps on warm endpoints is
    not homeless, so the check leaves it alone), and the balance still scores."""
    from kvgate.epp.scheduling.config import KVGATE_PROFILE_YAML

    profile = parse_config(KVGATE_PROFILE_YAML).scheduler.profiles[0]
    # (predicted-latency-scorer is a filter too, of requests stating objectives, off by default: it keeps them all)
    # (previous-response-affinity-filter first: it narrows only Responses requests continuing a stored response)
    assert [f.type_name for f in profile.filters] == ["previous-response-affinity-filter",
                                                      "prefix-cache-affinity-filter", "prefix-group-balance-scorer",
                                                      "predicted-latency-scorer"]
    assert profile.filters[2].fit_kv_capacity == 1.0
    assert profile.filters[2] in [ws.scorer for ws in profile.scorers]


# -------------------------------------------------------------------------------- no-hit-lru-scorer

def test_no_hit_lru_ranks_cold_requests_by_their_last_cold_pick():
    scheduler = Scheduler(parse_config(config("type: prefix-cache-scorer", "type: no-hit-lru-scorer")).scheduler)
    lru = scheduler.plugins_of_type("no-hit-lru-scorer")[0]
    states = [state("a:1"), state("b:1"), state("c:1"), state("d:1")]

    def score(prompt):
        cycle = cycle_for(scheduler, req(prompt), states)
        return list(lru.score(req(prompt), states, cycle)), cycle

    assert score("cold zero " * 30)[0] == [1.0, 1.0, 1.0, 1.0]  # nobody served a cold request yet: all tie
    for address, prompt in (("c:1", "cold one " * 30), ("a:1", "cold two " * 30)):
        cycle = cycle_for(scheduler, req(prompt), states)
        lru.score(req(prompt), states, cycle)
        scheduler.on_picked(req(prompt), states[addresses(states).index(address)], cycle)
    # b, d never: rank 0 → 1; c (older) rank 2 → 1 - 2/3; a (newest) rank 3 → 0
    assert score("cold three " * 30)[0] == pytest.approx([0.0, 1.0, 1 / 3, 1.0])
    # a warm request (c holds "cold one"'s prefix): neutral, and its pick does not count as cold
    warm, cycle = score("cold one " * 30)
    assert warm == [0.5] * 4
    scheduler.on_picked(req("cold one " * 30), states[1], cycle)
    assert score("cold four " * 30)[0] == pytest.approx([0.0, 1.0, 1 / 3, 1.0])
    lru.remove_endpoint("a:1")
    assert score("cold five " * 30)[0] == pytest.approx([1.0, 1.0, 0.0, 1.0])


def test_no_hit_lru_without_a_prefix_scorer_treats_every_request_as_cold_and_bounds_its_memory():
    lru = create_plugin("no-hit-lru-scorer", {"lruSize": 2})
    states = [state("a:1"), state("b:1"), state("c:1")]
    for s in states:
        cycle = CycleState()
        lru.score(req(), states, cycle)
        lru.pre_request(req(), s, cycle)
    assert list(lru._cold_picks) == ["b:1", "c:1"]  # a fell out: it ranks as never used
    assert list(lru.score(req(), states, CycleState())) == pytest.approx([1.0, 0.5, 0.0])


# -------------------------------------------------------------------------------- predicted-ttft-scorer

def ttft_state(address, pending=None, rate=None, running=0):
    m = EndpointMetrics(running_requests=running, prefill_tokens_pending=pending, prefill_tokens_per_s=rate,
                        prefill_rate_timed=rate is not None,
                        updated_at=time.monotonic())
    return EndpointState(Endpoint(address), m, stale=False)


def test_predicted_ttft_math():
    text = config("type: prefix-cache-scorer", "type: predicted-ttft-scorer\n  parameters: "
                  "{defaultPrefillTokensPerSecond: 1000, decodeMsPerRunningRequest: 2}")
    scheduler = Scheduler(parse_config(text).scheduler)
    ttft = scheduler.plugins_of_type("predicted-ttft-scorer")[0]
    states = [ttft_state("a:1", pending=2000, rate=4000, running=10),  # warm: 160 cached of 160
              ttft_state("b:1", pending=0, rate=None, running=0),  # idle, unmeasured: the default rate
              ttft_state("c:1", pending=None, rate=2000, running=50)]  # no backlog gauge (a vLLM engine)
    warmed(scheduler, states, {"a:1": PROMPT})
    tracker = LoadTracker()
    cycle = produced(scheduler, req(), states, CycleState(tracker.view(states)))
    time.sleep(0.001)
    tracker.add(LLMRequest("x", "m", "m", ""), "b:1", tokens=900, prompt_tokens=800)  # after b's scrape
    t = ttft.predict(req(), states, cycle)
    expected = [(2000 + 0 + 0) / 4000 + 10 * 0.002,  # 0.52 s
                (0 + 800 + 160) / 1000 + 1 * 0.002,  # 0.962 s: the unseen request counts in both terms
                (0 + 0 + 160) / 2000 + 50 * 0.002]  # 0.18 s
    assert t == pytest.approx(expected)
    lo, hi = min(expected), max(expected)
    assert ttft.score(req(), states, cycle) == pytest.approx([(hi - x) / (hi - lo) for x in expected])
    scheduler.on_picked(req(), states[0], cycle)
    assert cycle[PICKED_UNCACHED_TOKENS, "predicted-ttft-scorer"] == 0  # a held all of it
    assert scheduler.picked_uncached_tokens(cycle, 160) == 0  # the director adds no backlog there


def test_the_director_records_the_uncached_part_as_backlog():
    from tests.epp.test_live_load import one_round_director

    director, layer = one_round_director(parse_config(config("type: prefix-cache-scorer",
                                                             "type: predicted-ttft-scorer")), ["a:1", "b:1"])
    first = director.pick(req(rid="first"))[0].address  # cold everywhere: all 160 tokens to prefill
    view = director.load.view(layer.snapshot())
    assert view.unseen_prompt[view.positions[first]] == 160
    second = director.pick(req(PROMPT[:256] + "y" * 384, rid="second"))[0].address
    # `first` holds 4 of its 10 blocks (64 tokens) but has 160 unseen tokens to prefill: (160 + 96) / R there,
    # 160 / R on the other, which wins and prefills all 160
    assert second != first and view.unseen_prompt[view.positions[second]] == 160


# -------------------------------------------------------------------------------- prefill rate

def metrics_at(t, computed, pending):
    return EndpointMetrics(prefix_cache_queries=computed + 1000.0, prefix_cache_hits=1000.0,
                           prefill_tokens_pending=pending, updated_at=t)


def test_prefill_rate_counts_only_intervals_busy_throughout():
    est = PrefillRateEstimator()
    assert est.update(metrics_at(0.0, 0, 5000)) is None
    t, computed = 0.0, 0
    for _ in range(int(MIN_BUSY_S / 0.05) - 1):  # busy at 20k tokens/s, not yet MIN_BUSY_S of it
        t, computed = t + 0.05, computed + 1000
        assert est.update(metrics_at(t, computed, 5000)) is None
    for _ in range(2):  # MIN_BUSY_S reached (the sums decay a little as they grow)
        t, computed = t + 0.05, computed + 1000
        rate = est.update(metrics_at(t, computed, 5000))
    assert rate == pytest.approx(20000)
    # an interval where the backlog emptied (idle part) is not a sample; idle time keeps the estimate
    t, computed = t + 0.05, computed + 200
    assert est.update(metrics_at(t, computed, 0)) == pytest.approx(20000)
    t += 30.0
    assert est.update(metrics_at(t, computed, 0)) == pytest.approx(20000)
    # then busy at 5k tokens/s for 30 s (3 half-lives): the estimate has moved most of the way
    for _ in range(600):
        t, computed = t + 0.05, computed + 250
        rate = est.update(metrics_at(t, computed, 100))
    assert 5000 < rate < 5000 + 15000 * 0.5 ** 2.9
    # counters reset (an engine restart): skipped, not a negative sample
    assert est.update(metrics_at(t + 0.05, 0, 100)) == pytest.approx(rate)
    assert est.update(EndpointMetrics(updated_at=t + 0.1)) == pytest.approx(rate)  # engine without the metrics


def timed_at(t, computed, seconds, pending=0):
    return EndpointMetrics(prefill_tokens_computed=computed, prefill_step_seconds=seconds,
                           prefix_cache_queries=0.0, prefix_cache_hits=0.0, prefill_tokens_pending=pending,
                           updated_at=t)


def test_prefill_rate_from_the_engines_own_timing_holds_at_any_load():
    """kvgate engines time their prefill steps: the rate is tokens ÷ step seconds whether the engine is backlogged
    or idles between prompts (where the admission-based estimate would follow the arrivals instead)."""
    est = PrefillRateEstimator()
    assert est.update(timed_at(0.0, 0, 0.0)) is None and est.timed
    t, computed, seconds = 0.0, 0, 0.0
    for _ in range(20):  # one 1000-token prompt a second, prefilled in 0.1 s (10k tokens/s), the engine idle between
        t, computed, seconds = t + 1.0, computed + 1000, seconds + 0.1
        rate = est.update(timed_at(t, computed, seconds))
    assert rate == pytest.approx(10_000)
    assert est.update(timed_at(t + 5, computed, seconds)) == pytest.approx(10_000)  # idle keeps it
    assert est.update(timed_at(t + 6, 0, 0.0)) == pytest.approx(10_000)  # a restart (counters reset): skipped
    for bad in (float("nan"), float("inf")):
        assert est.update(timed_at(t + 7, bad, 1.0)) == pytest.approx(10_000)
    # an engine that stops timing itself (replaced by another build) starts over on the old method
    est.update(metrics_at(t + 8, 0, 100))
    assert not est.timed and est.estimate() is None


def test_the_vllm_dialect_reads_the_backlog_gauge_and_prefix_counters():
    page = ('vllm:num_requests_waiting{model_name="m"} 1.0\n'
            'kvgate:num_prefill_tokens_pending{model_name="m"} 4096.0\n'
            'vllm:prefix_cache_queries_total{model_name="m"} 9000.0\n'
            'vllm:prefix_cache_hits_total{model_name="m"} 3000.0\n')
    m = parse_metrics(page, DIALECTS["vllm"], 1.0)
    assert (m.prefill_tokens_pending, m.prefix_cache_queries, m.prefix_cache_hits) == (4096, 9000.0, 3000.0)
    assert (m.prefill_tokens_computed, m.prefill_step_seconds) == (None, None)
    timed = page + ('kvgate:prefill_tokens_computed_total{model_name="m"} 6000.0\n'
                    'kvgate:prefill_step_seconds_total{model_name="m"} 1.5\n')
    m = parse_metrics(timed, DIALECTS["vllm"], 1.0)
    assert (m.prefill_tokens_computed, m.prefill_step_seconds) == (6000.0, 1.5)
    assert (m.prefill_tokens_awaiting_step, m.step_age_s) == (None, None)
    phased = timed + ('kvgate:num_prefill_tokens_awaiting_step{model_name="m"} 96.0\n'
                      'kvgate:engine_step_age_seconds{model_name="m"} 0.125\n')
    m = parse_metrics(phased, DIALECTS["vllm"], 1.0)
    assert (m.prefill_tokens_awaiting_step, m.step_age_s) == (96, 0.125)
    m = parse_metrics('vllm:num_requests_waiting{model_name="m"} 1.0\n', DIALECTS["vllm"], 1.0)
    assert (m.prefill_tokens_pending, m.prefix_cache_queries) == (None, None)
    assert not math.isnan(np.float64(m.waiting_queue_size))


def test_through_the_director_affinity_sticks_until_the_in_flight_tokens_outweigh_the_hit():
    from tests.epp.test_live_load import one_round_director

    text = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: prefix-cache-scorer
- type: prefix-cache-affinity-filter
  parameters: {explorationProbability: 0}
- type: token-load-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: prefix-cache-affinity-filter
  - pluginRef: prefix-cache-scorer
    weight: 0
  - pluginRef: token-load-scorer
"""
    director, layer = one_round_director(parse_config(text), ["a:1", "b:1"])
    warmed(director.scheduler, layer.snapshot(), {"a:1": PROMPT})  # a holds all 160 tokens, b none
    picks = [director.pick(req(rid=f"r{i}", max_tokens=0))[0].address for i in range(3)]
    # in flight on a: 0, then 160 (≤ 160 saved: stay), then 320 (> 160: any endpoint, and b carries less)
    assert picks == ["a:1", "a:1", "b:1"]
