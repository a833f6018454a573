"""The autoscaling decision (operator/autoscale_policy.py): HPA's algorithm on the EPP's signals."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from kvgate.operator.autoscale_policy import MAX_HISTORY, Decision, Policy, Signals, decide, recommend

POLICY = Policy(min_replicas=0, max_replicas=10, target_waiting_per_replica=4, scale_down_stabilization_s=60,
                scale_down_delay_s=30)


def run(policy: Policy, signals_by_t, current: int = 1, ready=None, step_s: float = 5.0) -> list[Decision]:
    """Decisions every `step_s` seconds, each applied at once (ready = current unless given)."""
    out, history, last_up = [], (), None
    for i, signals in enumerate(signals_by_t):
        now = i * step_s
        d = decide(policy, signals, current, current if ready is None else ready, history, last_up, now)
        if d.desired > current:
            last_up = now
        current, history = d.desired, d.history
        out.append(d)
    return out


def test_from_zero_held_requests_start_one_replica_at_once():
    d = decide(POLICY, Signals(ready_endpoints=0, held=1, held_without_endpoints=1), 0, 0, (), None, 0.0)
    assert (d.desired, d.reason) == (1, "ScaledFromZero")
    assert "held with no ready endpoint" in d.message


def test_from_zero_starts_min_replicas_when_min_is_higher_than_one():
    policy = Policy(min_replicas=3, max_replicas=5)
    d = decide(policy, Signals(ready_endpoints=0, held=2), 0, 0, (), None, 0.0)
    assert d.desired == 3


def test_empty_pool_with_nothing_held_stays_at_zero():
    d = decide(POLICY, Signals(ready_endpoints=0), 0, 0, (), None, 0.0)
    assert (d.desired, d.reason) == (0, "Steady")


def test_load_step_scales_out_in_proportion_and_within_the_rate_limit():
    # 2 ready, 40 waiting, target 4 each: wants 10, the rate limit (4 pods or 100 %) allows 2 + 4
    d = decide(POLICY, Signals(ready_endpoints=2, waiting=30, held=10, running=8), 2, 2, (), None, 0.0)
    assert (d.desired, d.recommendation, d.reason) == (6, 10, "ScaledUp")
    assert "40 waiting (10 held by the EPP) on 2 ready endpoints" in d.message


def test_within_tolerance_nothing_changes():
    d = decide(POLICY, Signals(ready_endpoints=2, waiting=8.5, running=4), 2, 2, (), None, 0.0)
    assert (d.desired, d.reason) == (2, "Steady") and "within tolerance" in d.message


def test_kv_utilisation_and_queue_wait_are_signals_too():
    kv = decide(POLICY, Signals(ready_endpoints=2, running=2, kv_utilization=0.96), 2, 2, (), None, 0.0)
    assert kv.desired == 3 and "KV utilisation 0.96" in kv.message
    wait = decide(POLICY, Signals(ready_endpoints=2, running=2, queue_wait_s=3.0), 2, 2, (), None, 0.0)
    assert wait.desired == 6 and "queue wait 3.00s" in wait.message


def test_replicas_still_starting_are_not_scaled_away_while_load_is_high():
    d = decide(POLICY, Signals(ready_endpoints=1, waiting=6, running=4), 4, 1, (), None, 0.0)
    assert d.desired == 4  # 1 ready × 1.5 would say 2: the 3 starting ones are capacity on its way


def test_scale_down_waits_for_the_stabilisation_window_and_the_delay():
    busy = Signals(ready_endpoints=4, waiting=16, running=8)
    light = Signals(ready_endpoints=4, waiting=0, running=4)
    decisions = run(POLICY, [busy] + [light] * 20, current=4)
    counts = [d.desired for d in decisions]
    assert counts[0] == 4
    # light load asks for 4 × 0.0 → ... below 4, but the window holds 4 for 60 s (12 steps of 5 s)
    first_down = next(i for i, c in enumerate(counts) if c < 4)
    assert first_down * 5.0 > 60.0
    assert decisions[1].reason == "Stabilizing"


def test_idle_pool_scales_to_zero_only_after_the_window():
    idle = Signals(ready_endpoints=2)
    decisions = run(POLICY, [Signals(ready_endpoints=2, running=8, waiting=8)] + [idle] * 16, current=2)
    counts = [d.desired for d in decisions]
    assert counts[-1] == 0 and decisions[counts.index(0)].reason == "ScaledToZero"
    assert counts.index(0) * 5.0 > 60.0


def test_idle_pool_with_min_replicas_keeps_them():
    policy = Policy(min_replicas=1, max_replicas=4, scale_down_stabilization_s=0, scale_down_delay_s=0)
    d = decide(policy, Signals(ready_endpoints=3), 3, 3, (), None, 0.0)
    assert d.desired == 1


def test_no_scale_down_within_the_delay_after_a_scale_up():
    policy = Policy(min_replicas=1, max_replicas=8, scale_down_stabilization_s=0, scale_down_delay_s=30)
    d = decide(policy, Signals(ready_endpoints=4, running=1), 4, 4, (), last_scale_up_at=100.0, now=110.0)
    assert (d.desired, d.reason) == (4, "ScaleDownDelayed")
    d = decide(policy, Signals(ready_endpoints=4, running=1), 4, 4, (), last_scale_up_at=100.0, now=131.0)
    assert d.desired < 4


def test_scale_up_stabilisation_takes_the_lowest_recent_recommendation():
    policy = Policy(min_replicas=1, max_replicas=10, scale_up_stabilization_s=20)
    history = ((0.0, 2),)
    d = decide(policy, Signals(ready_endpoints=2, waiting=40, running=4), 2, 2, history, None, 10.0)
    assert d.desired == 2 and d.reason == "Stabilizing"
    d = decide(policy, Signals(ready_endpoints=2, waiting=40, running=4), 2, 2, d.history, None, 25.0)
    assert d.desired > 2


def test_missing_signals_keep_the_count():
    d = decide(POLICY, None, 3, 3, ((0.0, 5),), None, 1.0)
    assert (d.desired, d.reason) == (3, "FailedGetMetrics")
    assert decide(Policy(min_replicas=2, max_replicas=3), None, 7, 7, (), None, 0.0).desired == 3


def test_a_scaled_to_zero_share_of_a_loaded_pool_comes_back():
    # another ModelServer's endpoints are overloaded: this one, at 0, gets one replica
    assert recommend(POLICY, Signals(ready_endpoints=2, waiting=40, running=4), 0, 0)[0] == 1


signals = st.one_of(st.none(), st.builds(
    Signals, ready_endpoints=st.integers(0, 50), held=st.floats(0, 1e4), held_without_endpoints=st.floats(0, 1e4),
    waiting=st.floats(0, 1e4), running=st.floats(0, 1e4), kv_utilization=st.floats(0, 1),
    queue_wait_s=st.one_of(st.none(), st.floats(0, 600))))
policies = st.builds(
    lambda low, span, **kw: Policy(min_replicas=low, max_replicas=low + span, **kw),
    low=st.integers(0, 5), span=st.integers(0, 20), target_waiting_per_replica=st.floats(0.1, 100),
    target_kv_utilization=st.floats(0.05, 1), target_queue_wait_s=st.floats(0.01, 60), tolerance=st.floats(0, 0.5),
    scale_up_stabilization_s=st.floats(0, 600), scale_down_stabilization_s=st.floats(0, 3600),
    scale_down_delay_s=st.floats(0, 3600), scale_up_max_pods=st.integers(1, 10),
    scale_up_max_percent=st.floats(0, 1000))


@settings(max_examples=300, deadline=None)
@given(policy=policies, steps=st.lists(st.tuples(signals, st.floats(0.1, 120)), min_size=1, max_size=30),
       start=st.integers(0, 30))
def test_properties_over_a_run(policy, steps, start):
    current, history, last_up, now = start, (), None, 0.0
    for sig, dt in steps:
        now += dt
        d = decide(policy, sig, current, current, history, last_up, now)
        assert policy.min_replicas <= d.desired <= policy.max_replicas
        assert len(d.history) <= MAX_HISTORY
        inside = policy.min_replicas <= current <= policy.max_replicas
        if sig is None and inside:
            assert d.desired == current
        if inside and d.desired > current and current > 0:  # the rate limit (from zero goes straight to its count)
            assert d.desired - current <= max(policy.scale_up_max_pods,
                                              int(current * policy.scale_up_max_percent / 100))
        if inside and d.desired < current:
            assert last_up is None or now - last_up >= policy.scale_down_delay_s
            recent = [r for t, r in d.history if now - t <= policy.scale_down_stabilization_s]
            assert d.desired >= max(recent)
        if d.desired > current:
            last_up = now
        current, history = d.desired, d.history


def test_a_count_above_a_lowered_max_comes_down_even_within_the_delay():
    policy = Policy(min_replicas=0, max_replicas=2, scale_down_delay_s=600)
    d = decide(policy, Signals(ready_endpoints=5, waiting=50, running=10), 5, 5, (), last_scale_up_at=0.0, now=1.0)
    assert d.desired == 2
