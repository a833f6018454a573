"""`kvgate:num_prefill_tokens_pending` on a real sim server, in both engine-loop modes: the values a scraper sees
while known prompts are queued and prefilled are exactly the backlog's possible states, and it returns to 0; the
running step's phase (`kvgate:num_prefill_tokens_awaiting_step`, `kvgate:engine_step_age_seconds`) during one long
step."""

import asyncio

import httpx
import pytest

from tests.procs import KvgateServe, scrape

pytestmark = pytest.mark.processes

PHASE = ("kvgate:num_prefill_tokens_pending", "kvgate:num_prefill_tokens_awaiting_step",
         "kvgate:engine_step_age_seconds")
PROMPT = 160  # tokens per prompt, prefilled in chunks of CHUNK; one request at a time (--max-num-seqs 1)
CHUNK = 64
NUM_PROMPTS = 3


def possible_values() -> set[int]:
    """Whole prompts still waiting (their tokens in full) plus the one being prefilled: 160, 96, 32 or 0 left."""
    left_in_one = set(range(PROMPT, 0, -CHUNK)) | {0}
    return {PROMPT * waiting + left for waiting in range(NUM_PROMPTS) for left in left_in_one}


@pytest.mark.parametrize("engine_loop", ["thread", "process"])
def test_gauge_follows_the_prefill_backlog_exactly(kvgate_cache, engine_loop):
    # ~200 ms per 64-token chunk, so every state lasts several scrapes; no prefix cache, so nothing is skipped
    with KvgateServe("sim-8b", "--backend", "sim", "--engine-loop", engine_loop, "--max-num-seqs", "1",
                     "--max-num-batched-tokens", str(CHUNK), "--no-enable-prefix-caching",
                     "--sim-prefill-ms-per-token", "3", cache_dir=kvgate_cache) as server:
        assert scrape(server.url)["kvgate:num_prefill_tokens_pending"] == 0
        seen: list[float] = []

        async def main():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                async def watch():
                    while True:
                        r = await client.get("/metrics", params={"name[]": "kvgate:num_prefill_tokens_pending"})
                        value = next(float(line.split()[-1]) for line in r.text.splitlines()
                                     if line.startswith("kvgate:num_prefill_tokens_pending{"))
                        seen.append(value)
                        await asyncio.sleep(0.02)

                watcher = asyncio.create_task(watch())
                prompts = [[40 + i] + [65 + (j % 26) for j in range(PROMPT - 1)] for i in range(NUM_PROMPTS)]
                replies = await asyncio.gather(*(client.post("/v1/completions", json={
                    "prompt": p, "max_tokens": 2, "ignore_eos": True}) for p in prompts))
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
                return [r.status_code for r in replies]

        assert asyncio.run(main()) == [200] * NUM_PROMPTS
        observed = set(seen)
        assert observed <= possible_values(), sorted(observed - possible_values())
        # it moved through the states: with all three queued, then chunk by chunk
        assert max(observed) >= PROMPT * 2 and len(observed - {0}) >= 7, sorted(observed)
        after = scrape(server.url)
        assert after["kvgate:num_prefill_tokens_pending"] == 0
        # the engine timed its own prefill: every prompt token but the last (computed like a decode's), and the
        # steps that computed them — the sim sleeps its modelled 3 ms a token + 6 ms a step at least
        computed, seconds = after["kvgate:prefill_tokens_computed_total"], after["kvgate:prefill_step_seconds_total"]
        assert computed == NUM_PROMPTS * (PROMPT - 1)
        assert 150 < computed / seconds <= CHUNK / (CHUNK * 0.003 + 0.006), (computed, seconds)


@pytest.mark.parametrize("engine_loop", ["thread", "process"])
def test_a_request_that_arrives_during_a_step_counts_its_uncached_prompt(kvgate_cache, engine_loop):
    """A follower of a cold prompt arrives while the cold prompt's one long step runs, so the loop cannot take it
    yet: the gauge counts its uncached tokens (the arrival probe found the cold prompt's blocks, entered when the
    step was scheduled), not its whole prompt (engine_loop.arrival_probe)."""
    cold = [40] + [65 + (j % 26) for j in range(159)]  # 160 tokens: 10 full blocks of 16
    follower = cold + [70] * 32  # 192 tokens, 160 of them cached once the cold step is scheduled
    # ~3.2 s for the cold prompt's step (20 ms a token), in which the follower arrives after 1 s
    with KvgateServe("sim-8b", "--backend", "sim", "--engine-loop", engine_loop, "--sim-prefill-ms-per-token", "20",
                     cache_dir=kvgate_cache) as server:
        seen: list[float] = []
        phase: list[tuple[float, float]] = []  # (tokens awaiting a step, the running step's age) at each scrape

        async def main():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                async def gauge() -> float:
                    r = await client.get("/metrics", params={"name[]": list(PHASE)})
                    values = {line.split("{")[0]: float(line.split()[-1]) for line in r.text.splitlines()
                              if line.startswith(PHASE)}
                    phase.append((values[PHASE[1]], values[PHASE[2]]))
                    return values[PHASE[0]]

                first = asyncio.create_task(client.post("/v1/completions", json={
                    "prompt": cold, "max_tokens": 1}))
                await asyncio.sleep(1.0)
                second = asyncio.create_task(client.post("/v1/completions", json={
                    "prompt": follower, "max_tokens": 1}))
                while not first.done() and len(seen) < 1000:
                    seen.append(await gauge())
                    if seen[-1] == 160 + 32:
                        break
                    await asyncio.sleep(0.01)
                during = not first.done()
                replies = await asyncio.gather(first, second)
                return during, [r.status_code for r in replies]

        during, codes = asyncio.run(main())
        assert codes == [200, 200]
        # the cold prompt whole (unreported, nothing cached) + the follower's 32 uncached tokens, while the step ran;
        # counted whole, the follower made it 352 for the step's whole length
        assert during and seen[-1] == 192, seen
        assert set(seen) <= {160, 352, 192}, seen  # 352 only in process mode, until the probe crosses the pipe
        # The step's phase: the cold prompt is in the running step (the loop reported taking it before stepping),
        # the follower awaits the next one; the step has run since the cold prompt came, ~1 s before the follower.
        awaiting, age = phase[-1]
        assert awaiting == 32 and 0.5 < age < 5.0, phase  # bounds loose for a loaded machine
        assert all(a in (0, 32, 192) for a, _ in phase), phase
        assert [age for _, age in phase] == sorted(age for _, age in phase), phase  # one step: its age only grows
        after = scrape(server.url)
        assert after[PHASE[1]] == 0 and after[PHASE[2]] == 0.0
        assert scrape(server.url)["kvgate:num_prefill_tokens_pending"] == 0
