"""The datalayer against real HTTP servers on loopback: pick-up, keep-alive, staleness, churn, dialects."""

from __future__ import annotations

import asyncio
import math
import time

import httpx
import pytest

from kvgate.epp.datalayer import (DIALECTS, Datalayer, MetricsConnection, MetricsParseError, iter_samples,
                                  parse_labels, parse_metrics)
from kvgate.epp.datalayer import collector as collector_module
from kvgate.epp.types import Endpoint
from tests.procs import KvgateServe


def vllm_page(waiting=0, running=0, usage=0.0, *, lora_running="", lora_waiting="", max_lora=0):
    return f"""# HELP vllm:num_requests_running Requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{model_name="m"}} {running}.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{model_name="m"}} {waiting}.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{model_name="m"}} {usage}
vllm:cache_config_info{{block_size="16",model_name="m",num_gpu_blocks="4096"}} 1.0
vllm:lora_requests_info{{max_lora="{max_lora}",running_lora_adapters="{lora_running}",\
waiting_lora_adapters="{lora_waiting}"}} 1.7e+09
vllm:e2e_request_latency_seconds_bucket{{le="0.1",model_name="m"}} 3.0
"""


class FakeEngine:
    """A keep-alive HTTP/1.1 server on a free loopback port answering /metrics with `text`."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.status = 200
        self.chunked = False
        self.silent = False  # accept requests but never answer
        self.reject_query = False  # answer 404 to /metrics?... (a server without the name[] filter may)
        self.paths: list[str] = []
        self.connections = 0
        self.requests = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self.server: asyncio.Server | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> "FakeEngine":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        self.server.close()
        for w in list(self._writers):
            w.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        try:
            while True:
                request = await reader.readuntil(b"\r\n\r\n")
                self.requests += 1
                path = request.split(b" ", 2)[1].decode()
                self.paths.append(path)
                if self.silent:
                    continue
                body = self.text.encode()
                status = 404 if self.reject_query and "?" in path else self.status
                head = f"HTTP/1.1 {status} X\r\nContent-Type: text/plain\r\n"
                if self.chunked:
                    half = len(body) // 2
                    chunks = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (body[:half], body[half:]) if c)
                    writer.write(f"{head}Transfer-Encoding: chunked\r\n\r\n".encode() + chunks + b"0\r\n\r\n")
                else:
                    writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()


async def wait_until(predicate, timeout: float = 2.0, step: float = 0.01) -> float:
    """Seconds waited until predicate() held; fails the test after `timeout`."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(step)
    return time.monotonic() - start


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def metrics_of(layer: Datalayer, address: str):
    return layer.metrics(address)


# ------------------------------------------------------------------------------------------- collectors

def test_values_are_picked_up_within_a_few_intervals_over_one_connection():
    async def main():
        engine = await FakeEngine(vllm_page(waiting=3, running=2, usage=0.25)).start()
        layer = Datalayer(interval=0.02, staleness=1.0)
        try:
            layer.set_endpoints([Endpoint(engine.address)])
            assert layer.states()[0].stale  # never scraped yet
            await layer.start()
            await wait_until(lambda: metrics_of(layer, engine.address).waiting_queue_size == 3, timeout=1.0)
            m = metrics_of(layer, engine.address)
            assert (m.running_requests, m.kv_cache_usage, m.kv_block_size, m.num_kv_blocks) == (2, 0.25, 16, 4096)
            engine.text = vllm_page(waiting=7, usage=0.5)
            waited = await wait_until(lambda: metrics_of(layer, engine.address).waiting_queue_size == 7, timeout=1.0)
            assert waited < 0.5
            state = layer.states({engine.address: (4, 900)})[0]
            assert not state.stale and (state.in_flight_requests, state.in_flight_tokens) == (4, 900)
            await wait_until(lambda: engine.requests >= 10)
            assert engine.connections == 1  # keep-alive
        finally:
            await layer.stop()
            await engine.stop()

    run(main())


def test_metrics_go_stale_when_the_server_stops_answering_and_recover():
    async def main():
        engine = await FakeEngine(vllm_page(waiting=2)).start()
        layer = Datalayer(interval=0.02, staleness=0.3)
        try:
            layer.set_endpoints([Endpoint(engine.address)])
            await layer.start()
            await wait_until(lambda: not layer.states()[0].stale)
            await engine.stop()
            stopped = time.monotonic()
            await wait_until(lambda: layer.states()[0].stale, timeout=2.0)
            # Out of rotation after two refused scrapes (~2 intervals), not after the 0.3 s staleness threshold.
            assert time.monotonic() - stopped < 0.2
            assert layer.states()[0].metrics.waiting_queue_size == 2  # failed scrapes keep the old numbers
            assert layer.stats()["failures"] > 0
            engine.text = vllm_page(waiting=5)
            await engine.start()  # same port
            await wait_until(lambda: not layer.states()[0].stale and
                             layer.states()[0].metrics.waiting_queue_size == 5, timeout=2.0)
        finally:
            await layer.stop()
            await engine.stop()

    run(main())


def test_error_status_and_unanswered_requests_keep_old_metrics():
    async def main():
        engine = await FakeEngine(vllm_page(waiting=1)).start()
        layer = Datalayer(interval=0.02, timeout=0.2, staleness=5.0)
        try:
            layer.set_endpoints([Endpoint(engine.address)])
            await layer.start()
            await wait_until(lambda: layer.states()[0].metrics.waiting_queue_size == 1)
            engine.status, engine.text = 500, vllm_page(waiting=9)
            failures = layer.stats()["failures"]
            await wait_until(lambda: layer.stats()["failures"] >= failures + 3)
            assert layer.states()[0].metrics.waiting_queue_size == 1
            engine.status, engine.silent = 200, True
            before = engine.requests
            await asyncio.sleep(0.5)
            # Each unanswered request times out (0.2 s) and the connection is dropped: no busy retry loop.
            assert engine.requests - before <= 4
            assert layer.states()[0].metrics.waiting_queue_size == 1
            engine.silent = False
            await wait_until(lambda: layer.states()[0].metrics.waiting_queue_size == 9, timeout=2.0)
        finally:
            await layer.stop()
            await engine.stop()

    run(main())


def test_chunked_responses_are_read():
    async def main():
        engine = await FakeEngine(vllm_page(waiting=4, usage=0.5)).start()
        engine.chunked = True
        layer = Datalayer(interval=0.02)
        try:
            layer.set_endpoints([Endpoint(engine.address)])
            await layer.start()
            await wait_until(lambda: layer.states()[0].metrics.waiting_queue_size == 4)
            assert layer.states()[0].metrics.kv_cache_usage == 0.5
        finally:
            await layer.stop()
            await engine.stop()

    run(main())


def test_collectors_are_added_and_removed_cleanly():
    async def main():
        a = await FakeEngine(vllm_page(waiting=1)).start()
        b = await FakeEngine(vllm_page(waiting=2)).start()
        changes = []
        layer = Datalayer(interval=0.02, on_change=lambda address, m: changes.append(
            (address, None if m is None else m.waiting_queue_size)))
        try:
            await layer.start()
            layer.set_endpoints([Endpoint(a.address)])
            await wait_until(lambda: (a.address, 1) in changes)
            layer.set_endpoints([Endpoint(a.address), Endpoint(b.address)])
            await wait_until(lambda: (b.address, 2) in changes)
            collector_a = layer._collectors[a.address]
            layer.set_endpoints([Endpoint(a.address, name="pod-a"), Endpoint(b.address)])  # idempotent
            assert layer._collectors[a.address] is collector_a
            assert layer.endpoints()[0].name == "pod-a"
            assert not layer.states()[0].stale  # kept its metrics
            layer.set_endpoints([Endpoint(b.address)])
            assert [s.address for s in layer.states()] == [b.address]
            assert (a.address, None) in changes
            assert collector_a.removed and not collector_a.connection.connected
            scraped = a.requests
            await asyncio.sleep(0.1)
            assert a.requests == scraped  # no scrapes after removal
            await wait_until(lambda: not a._writers)  # the removed collector closed its connection
        finally:
            await layer.stop()
            await a.stop()
            await b.stop()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert not [t for t in others if t.get_name().startswith("metrics ")]

    run(main())


def test_set_endpoints_before_start_and_stop_is_idempotent():
    async def main():
        engine = await FakeEngine(vllm_page(waiting=6)).start()
        layer = Datalayer(interval=0.02)
        layer.set_endpoints([Endpoint(engine.address)])
        try:
            await layer.start()
            await layer.start()
            await wait_until(lambda: layer.states()[0].metrics.waiting_queue_size == 6)
        finally:
            await layer.stop()
            await layer.stop()
            await engine.stop()
        assert not layer.running

    run(main())


@pytest.fixture
def no_read_backoff(monkeypatch):
    monkeypatch.setattr(collector_module, "READ_BACKOFF", 0.0)


class ManualTicker:
    """An injected ticker: a round runs when the test says so. Its tests turn the read backoff off (no_read_backoff):
    a round that came before an endpoint's hold-back ended would skip it, and no later round would come."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()

    def tick(self) -> None:
        self.queue.put_nowait(None)

    async def ticks(self):
        loop = asyncio.get_running_loop()
        while True:
            await self.queue.get()
            yield loop.time()


def test_one_injected_ticker_drives_every_collector(no_read_backoff):
    async def main():
        engines = [await FakeEngine(vllm_page(waiting=i)).start() for i in range(5)]
        ticker = ManualTicker()
        layer = Datalayer(interval=0.02, ticker=ticker)
        try:
            layer.set_endpoints([Endpoint(e.address) for e in engines])
            await layer.start()
            await asyncio.sleep(0.1)
            assert all(e.requests == 0 for e in engines)  # no round, no scrape
            for round_ in range(1, 4):
                ticker.tick()
                await wait_until(lambda: all(e.requests == round_ for e in engines))
            assert [layer.metrics(e.address).waiting_queue_size for e in engines] == [0, 1, 2, 3, 4]
            await asyncio.sleep(0.1)
            assert all(e.requests == 3 for e in engines)  # exactly one request per endpoint per round
            names = [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("metrics")]
            assert names == ["metrics ticker"]  # one task for the whole pool once connected
        finally:
            await layer.stop()
            for e in engines:
                await e.stop()

    run(main())


def test_one_failed_scrape_keeps_an_endpoint_in_rotation_two_take_it_out(no_read_backoff):
    async def main():
        engine = await FakeEngine(vllm_page(waiting=1)).start()
        ticker = ManualTicker()
        layer = Datalayer(interval=0.02, staleness=60.0, ticker=ticker)

        async def round_(n):
            ticker.tick()
            await wait_until(lambda: layer.stats()["scrapes"] + layer.stats()["failures"] == n)

        try:
            layer.set_endpoints([Endpoint(engine.address)])
            await layer.start()
            await round_(1)
            assert not layer.states()[0].stale
            engine.status = 503  # e.g. an engine whose loop died answers /metrics with 503
            await round_(2)
            assert not layer.states()[0].stale  # one failure: a blip, not a verdict
            await round_(3)
            assert layer.states()[0].stale  # two in a row: out of rotation, long before the 60 s threshold
            engine.status = 200
            await round_(4)
            assert not layer.states()[0].stale  # the first good scrape brings it back
        finally:
            await layer.stop()
            await engine.stop()

    run(main())


def test_only_the_dialects_families_are_asked_for_and_a_server_that_refuses_gets_the_whole_page():
    async def main():
        taking = await FakeEngine(vllm_page(waiting=2)).start()
        refusing = await FakeEngine(vllm_page(waiting=3)).start()
        refusing.reject_query = True
        layer = Datalayer(interval=0.02)
        try:
            layer.set_endpoints([Endpoint(taking.address), Endpoint(refusing.address)])
            await layer.start()
            await wait_until(lambda: layer.metrics(refusing.address).waiting_queue_size == 3)
            assert layer.metrics(taking.address).waiting_queue_size == 2
            assert set(taking.paths) == {DIALECTS["vllm"].metrics_path()}
            assert "name%5B%5D=vllm%3Anum_requests_waiting" in taking.paths[0]
            assert refusing.paths[0] == DIALECTS["vllm"].metrics_path() and refusing.paths[-1] == "/metrics"
            # TRT-LLM's server has no filter: always the plain path
            assert DIALECTS["trtllm"].metrics_path() == "/metrics"
        finally:
            await layer.stop()
            await taking.stop()
            await refusing.stop()

    run(main())


def test_a_byte_identical_body_is_not_parsed_again_but_counts_as_fresh(monkeypatch):
    parsed = []
    real = collector_module.parse_metrics
    monkeypatch.setattr(collector_module, "parse_metrics", lambda *a: parsed.append(1) or real(*a))

    async def main():
        engine = await FakeEngine(vllm_page(waiting=4)).start()
        layer = Datalayer(interval=0.02, staleness=0.2)
        try:
            layer.set_endpoints([Endpoint(engine.address)])
            await layer.start()
            await wait_until(lambda: engine.requests >= 20, timeout=3.0)
            assert len(parsed) == 1 and layer.metrics(engine.address).waiting_queue_size == 4
            assert not layer.states()[0].stale and layer.stats()["scrapes"] >= 19
            engine.text = vllm_page(waiting=6)
            await wait_until(lambda: layer.metrics(engine.address).waiting_queue_size == 6)
            assert len(parsed) == 2
        finally:
            await layer.stop()
            await engine.stop()

    run(main())


def test_metrics_connection_get_reads_one_answer_and_times_out():
    async def main():
        engine = await FakeEngine(vllm_page(waiting=1)).start()
        connection = MetricsConnection(engine.address, timeout=0.2)
        try:
            status, body = await connection.get()
            assert status == 200 and b"vllm:num_requests_waiting" in body
            engine.silent = True
            with pytest.raises(TimeoutError):
                await connection.get()
            assert not connection.connected  # a late answer must not be read as the next one's
        finally:
            connection.close()
            await engine.stop()

    run(main())


def test_the_log_says_once_which_prefill_speed_signal_an_endpoint_gives(caplog):
    """A vLLM page (no prefill timing): said once however often it is scraped; the engine starting to time its
    prefill (an upgrade behind the same address) is said when seen."""
    timing = ("kvgate:prefill_tokens_computed_total{model_name=\"m\"} 100.0\n"
              "kvgate:prefill_step_seconds_total{model_name=\"m\"} 0.5\n")

    async def main():
        engine = await FakeEngine(vllm_page(waiting=1)).start()
        layer = Datalayer(interval=0.02, filter_families=False)
        try:
            layer.set_endpoints([Endpoint(engine.address)])
            await layer.start()
            await wait_until(lambda: engine.requests >= 5)
            engine.text = vllm_page(waiting=2) + timing
            await wait_until(lambda: metrics_of(layer, engine.address).prefill_step_seconds == 0.5)
            await wait_until(lambda: engine.requests >= 15)
        finally:
            await layer.stop()
            await engine.stop()
        return engine.address

    with caplog.at_level("INFO", logger="kvgate.epp.datalayer"):
        address = run(main())
    said = [r.getMessage() for r in caplog.records if "prefill" in r.getMessage()]
    assert said == [f"{address} exports no prefill timing (kvgate:prefill_step_seconds_total; e.g. a vLLM engine): "
                    "its loads count at the median speed of the timed endpoints, or in tokens where none is timed",
                    f"{address} times its own prefill (kvgate:prefill_step_seconds_total): its loads count in seconds "
                    "of its measured prefill speed"], said


@pytest.mark.processes
def test_against_a_real_kvgate_sim_engine(tmp_path, caplog):
    async def main(url: str, address: str):
        layer = Datalayer(interval=0.05)
        try:
            layer.set_endpoints([Endpoint(address)])
            await layer.start()
            await wait_until(lambda: not layer.states()[0].stale, timeout=5.0)
            m = layer.states()[0].metrics
            assert m.kv_block_size == 16 and m.num_kv_blocks and m.max_lora == 0
            assert layer._collectors[address].filtered  # the engine took the name[] filter
            async with httpx.AsyncClient(timeout=10) as client:
                whole = (await client.get(url + "/metrics")).text
                page = (await client.get(url + DIALECTS["vllm"].metrics_path())).text
                head = await client.head(url + "/metrics")
                post = await client.post(url + "/metrics")
            assert head.status_code == 200 and head.content == b"" and int(head.headers["content-length"]) > 1000
            assert post.status_code == 405  # only GET and HEAD are answered ahead of the stack
            samples = {line.split("{")[0].split(" ")[0] for line in page.splitlines() if not line.startswith("#")}
            assert samples == {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                               "vllm:lora_requests_info", "vllm:cache_config_info",
                               "kvgate:num_prefill_tokens_pending", "kvgate:num_prefill_tokens_awaiting_step",
                               "kvgate:engine_step_age_seconds", "vllm:prefix_cache_queries_total",
                               "vllm:prefix_cache_hits_total", "kvgate:prefill_tokens_computed_total",
                               "kvgate:prefill_step_seconds_total", "kvgate:ttft_model_weight",
                               "kvgate:tpot_model_weight", "kvgate:latency_model_observations_total"}
            assert m.prefill_tokens_pending == 0 and m.prefix_cache_queries == m.prefix_cache_hits == 0
            assert m.prefill_tokens_awaiting_step == 0 and m.step_age_s == 0.0 and m.prefill_backlog == 0
            # 16 of the page's families read, its histograms not (the whole page of an idle engine lists them empty)
            assert "vllm:request_queue_time_seconds" in whole and "vllm:request_queue_time_seconds" not in page
            assert len(page) < 0.85 * len(whole)
            assert m.ttft_model_observations == 0 and m.ttft_model_weights is not None  # the engine's latency model
            busy = []
            async with httpx.AsyncClient(timeout=60) as client:
                body = {"model": "sim-8b", "prompt": "hello " * 200, "max_tokens": 64, "ignore_eos": True}
                requests = [asyncio.create_task(client.post(url + "/v1/completions", json=body)) for _ in range(6)]

                def saw_load():
                    s = layer.states()[0].metrics
                    busy.append((s.running_requests, s.waiting_queue_size, s.kv_cache_usage))
                    return s.running_requests + s.waiting_queue_size > 0 and s.kv_cache_usage > 0

                await wait_until(saw_load, timeout=10.0)
                responses = await asyncio.gather(*requests)
            assert all(r.status_code == 200 for r in responses)
            await wait_until(lambda: layer.states()[0].metrics.running_requests == 0, timeout=5.0)
            # the engine's prefix-cache counters (the prefill-rate estimator's input) came through the filter
            await wait_until(lambda: (layer.states()[0].metrics.prefix_cache_queries or 0) >= 6 * 200, timeout=5.0)
            assert layer.states()[0].metrics.prefill_tokens_pending == 0
            # and the engine's own prefill timing, from which the rate comes: the prompt tokens it did not find
            # cached (six alike), but each prompt's last, which is computed like a decode's
            m = layer.states()[0].metrics
            assert 0 < m.prefill_tokens_computed <= m.prefix_cache_queries - m.prefix_cache_hits
            assert m.prefill_step_seconds > 0
            # each of the six requests was fitted by the engine's latency model (common/engine_latency_protocol.py)
            await wait_until(lambda: layer.states()[0].metrics.ttft_model_observations == 6, timeout=5.0)
        finally:
            await layer.stop()

    with KvgateServe("sim-8b", "--backend", "sim", cache_dir=tmp_path) as server, \
            caplog.at_level("INFO", logger="kvgate.epp.datalayer"):
        run(main(server.url, f"{server.host}:{server.port}"))
    # a kvgate engine times its own prefill: the EPP says so (the speed-aware loads use it)
    assert [r.getMessage() for r in caplog.records if "prefill" in r.getMessage()] == [
        f"{server.host}:{server.port} times its own prefill (kvgate:prefill_step_seconds_total): its loads count in "
        "seconds of its measured prefill speed"]


# ------------------------------------------------------------------------------------------- dialects

def test_vllm_page_with_labels():
    text = vllm_page(waiting=3, running=5, usage=0.4, lora_running="sql, chat", lora_waiting="math",
                     max_lora=4) + 'vllm:num_requests_waiting{model_name="other"} 2.0\n'
    m = parse_metrics(text, DIALECTS["vllm"], 12.0)
    assert (m.waiting_queue_size, m.running_requests, m.kv_cache_usage, m.updated_at) == (3, 5, 0.4, 12.0)
    assert (m.max_lora, m.running_loras, m.waiting_loras) == (4, {"sql", "chat"}, {"math"})


def test_vllm_sums_label_sets_and_takes_max_usage():
    text = """vllm:num_requests_waiting{engine="0"} 2
vllm:num_requests_waiting{engine="1"} 3
vllm:num_requests_running{engine="0"} 1
vllm:num_requests_running{engine="1"} 4
vllm:kv_cache_usage_perc{engine="0"} 0.2
vllm:kv_cache_usage_perc{engine="1"} 0.7
"""
    m = parse_metrics(text, DIALECTS["vllm"])
    assert (m.waiting_queue_size, m.running_requests, m.kv_cache_usage) == (5, 5, 0.7)


def test_vllm_older_gpu_cache_usage_and_unlabelled_samples():
    text = "vllm:num_requests_waiting 4\nvllm:num_requests_running 1\nvllm:gpu_cache_usage_perc 0.3\n"
    m = parse_metrics(text, DIALECTS["vllm"])
    assert (m.waiting_queue_size, m.running_requests, m.kv_cache_usage) == (4, 1, 0.3)
    assert m.kv_block_size is None and m.max_lora == 0


def test_vllm_lora_takes_the_newest_sample():
    text = """vllm:num_requests_waiting 0
vllm:lora_requests_info{max_lora="2",running_lora_adapters="old",waiting_lora_adapters=""} 100.0
vllm:lora_requests_info{max_lora="2",running_lora_adapters="new1,new2",waiting_lora_adapters="w"} 200.0
vllm:lora_requests_info{max_lora="2",running_lora_adapters="older",waiting_lora_adapters=""} 50.0
"""
    m = parse_metrics(text, DIALECTS["vllm"])
    assert m.running_loras == {"new1", "new2"} and m.waiting_loras == {"w"}


def test_sglang_page():
    text = """# HELP sglang:num_queue_reqs The number of requests in the waiting queue
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="qwen",engine_type="unified",tp_rank="0"} 6.0
sglang:num_queue_reqs{model_name="qwen",engine_type="unified",tp_rank="1"} 1.0
sglang:num_running_reqs{model_name="qwen",engine_type="unified",tp_rank="0"} 12.0
sglang:token_usage{model_name="qwen",engine_type="unified",tp_rank="0"} 0.52
sglang:token_usage{model_name="qwen",engine_type="unified",tp_rank="1"} 0.61
sglang:cache_hit_rate{model_name="qwen"} 0.3
"""
    m = parse_metrics(text, DIALECTS["sglang"])
    assert (m.waiting_queue_size, m.running_requests, m.kv_cache_usage) == (7, 12, 0.61)


def test_trtllm_page_filters_by_label():
    text = """nv_trt_llm_request_metrics{model="ensemble",request_type="context",version="1"} 3
nv_trt_llm_request_metrics{model="ensemble",request_type="scheduled",version="1"} 8
nv_trt_llm_request_metrics{model="ensemble",request_type="max",version="1"} 64
nv_trt_llm_request_metrics{model="ensemble",request_type="waiting",version="1"} 2
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction",model="ensemble",version="1"} 0.35
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="tokens_per",model="ensemble",version="1"} 64
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="ensemble",version="1"} 2000
"""
    m = parse_metrics(text, DIALECTS["trtllm"])
    assert (m.waiting_queue_size, m.running_requests, m.kv_cache_usage) == (2, 8, 0.35)
    assert (m.kv_block_size, m.num_kv_blocks) == (64, 2000)


def test_scanner_edge_cases():
    text = ("vllm:num_requests_waiting_by_reason{reason=\"x\"} 9\n"  # a longer family name: not ours
            "vllm:num_requests_waiting{a=\"1\"} NaN\n"
            "vllm:num_requests_waiting{a=\"2\"} 3 1700000000000\n"  # with a timestamp
            "vllm:num_requests_waiting{a=\"3\"} 1e0")
    values = [v for _, v in iter_samples(text, "vllm:num_requests_waiting")]
    assert math.isnan(values[0]) and values[1:] == [3.0, 1.0]  # NaN is the parse's checks' to drop
    assert parse_metrics(text, DIALECTS["vllm"]).waiting_queue_size == 4
    assert parse_labels(r'a="x\"y",b="c,d",c="\\"') == {"a": 'x"y', "b": "c,d", "c": "\\"}


def test_page_without_any_known_family_is_an_error():
    with pytest.raises(MetricsParseError):
        parse_metrics("<html>not metrics</html>", DIALECTS["vllm"])
    with pytest.raises(MetricsParseError):
        parse_metrics(vllm_page(), DIALECTS["sglang"])


# ------------------------------------------------------------------------------------- a large pool's rounds

@pytest.mark.parametrize("turn_s, seen", [(0.0, 1), (60.0, 20)])
def test_a_burst_of_answers_is_parsed_in_turns_with_the_sockets_polled_between(monkeypatch, turn_s, seen):
    """Twenty answers arrive at once while a request's message waits on another socket: with a turn of one page
    the message is served after the first page, not after the twenty (a long turn shows the difference)."""
    import socket

    monkeypatch.setattr(collector_module, "ANSWER_TURN_S", turn_s)
    page = vllm_page(waiting=2).encode()

    async def main():
        layer = Datalayer(interval=0.05, ticker=ManualTicker())  # no round runs: the answers come from the test
        layer.set_endpoints([Endpoint(f"127.0.0.1:{9000 + i}") for i in range(20)])
        await layer.start()
        request_side, client_side = socket.socketpair()
        request_side.setblocking(False)
        loop = asyncio.get_running_loop()
        served = loop.create_future()
        try:
            client_side.send(b"x")  # a request's message, waiting
            loop.add_reader(request_side, lambda: served.done() or served.set_result(layer.stats()["scrapes"]))
            for address in [e.address for e in layer.endpoints()]:  # the connections' callbacks, one burst
                layer._collectors[address].answered(200, page, None)
            assert await served == seen
            await wait_until(lambda: layer.stats()["scrapes"] == 20)
            assert all(layer.metrics(e.address).waiting_queue_size == 2 for e in layer.endpoints())
        finally:
            loop.remove_reader(request_side)
            request_side.close()
            client_side.close()
            await layer.stop()

    run(main())


def test_a_round_of_a_large_pool_is_spread_over_the_interval_in_slices(monkeypatch, no_read_backoff):
    """Six endpoints in slices of two, a 0.3 s interval: three slices 0.1 s apart; a pool no larger than a slice is
    asked at once."""
    sent: list[tuple[str, float]] = []
    scrape = collector_module.EndpointCollector.scrape

    def recording(self, now):
        if self.sent_at is None:
            sent.append((self.endpoint.address, asyncio.get_running_loop().time()))
        scrape(self, now)

    monkeypatch.setattr(collector_module.EndpointCollector, "scrape", recording)

    async def first_round(slice_size: int) -> list[float]:
        monkeypatch.setattr(collector_module, "ROUND_SLICE", slice_size)
        sent.clear()
        engines = [await FakeEngine(vllm_page()).start() for _ in range(6)]
        layer = Datalayer(interval=0.3)
        try:
            layer.set_endpoints([Endpoint(e.address) for e in engines])
            await layer.start()
            await wait_until(lambda: len(sent) >= 6)
        finally:
            await layer.stop()
            for e in engines:
                await e.stop()
        times = [t for _, t in sent[:6]]
        assert len({a for a, _ in sent[:6]}) == 6  # each endpoint once in the round
        return [t - times[0] for t in times]

    async def main():
        spread = await first_round(2)
        assert spread[1] < 0.05 and 0.07 < spread[2] < 0.2 and 0.17 < spread[4] < 0.3, spread
        at_once = await first_round(50)
        assert max(at_once) < 0.05, at_once

    run(main())


def test_scraping_is_held_to_its_share_of_the_loop(monkeypatch, no_read_backoff):
    """A round whose scraping took c seconds of the loop is followed by the next no sooner than c / share after it
    began: with a share of 1/5000, a 20 ms interval slows to a few rounds a second; with the default share the
    interval holds."""
    async def rounds_in(seconds: float) -> tuple[int, float]:
        engines = [await FakeEngine(vllm_page()).start() for _ in range(3)]
        layer = Datalayer(interval=0.02)
        try:
            layer.set_endpoints([Endpoint(e.address) for e in engines])
            await layer.start()
            await wait_until(lambda: layer.stats()["scrapes"] >= 3)
            rounds, cpu, t0 = layer.rounds, layer.scrape_cpu_s, time.perf_counter()
            await asyncio.sleep(seconds)
            return layer.rounds - rounds, (layer.scrape_cpu_s - cpu) / (time.perf_counter() - t0)
        finally:
            await layer.stop()
            for e in engines:
                await e.stop()

    async def main():
        rounds, _ = await rounds_in(1.0)
        assert rounds >= 15, rounds  # 50 at the interval; a loaded machine's sleeps run late
        monkeypatch.setattr(collector_module, "SCRAPE_LOOP_SHARE", 0.0002)
        rounds, share = await rounds_in(1.0)
        assert 1 <= rounds <= 6, rounds
        assert share < 0.002, share  # the share held, with a round's slack

    run(main())


def test_a_running_layer_builds_the_next_snapshot_after_its_round_not_on_a_decision(no_read_backoff):
    """While decisions are made, the round's snapshot is built when the round's scrapes are out (off the request
    path); a decision between rounds gets that one, whatever its age, with the in-flight counts of the round's end.
    After a round without decisions the next decision builds its own."""
    async def main():
        engine = await FakeEngine(vllm_page(waiting=2)).start()
        ticker = ManualTicker()
        layer = Datalayer(interval=0.001, ticker=ticker)  # an interval far shorter than the rounds the test makes
        in_flight = {engine.address: (1, 10)}
        calls = []

        def source():
            calls.append(1)
            return dict(in_flight)

        try:
            layer.set_endpoints([Endpoint(engine.address)])
            await layer.start()
            first = layer.snapshot(source)  # no round yet: the decision builds one
            assert len(calls) == 1 and first[0].in_flight_requests == 1
            await asyncio.sleep(0.01)
            assert layer.snapshot(source) is first and len(calls) == 1  # older than the interval, still the round's
            in_flight[engine.address] = (3, 30)
            ticker.tick()
            await wait_until(lambda: len(calls) == 2)  # built at the round, no decision asking
            second = layer.snapshot(source)
            assert second is not first and second[0].in_flight_requests == 3 and len(calls) == 2
            ticker.tick()  # a decision used `second`: the round builds the next
            await wait_until(lambda: len(calls) == 3)
            ticker.tick()  # no decision since: nothing built, the next decision builds its own
            await wait_until(lambda: layer.stats()["scrapes"] == 3)
            await asyncio.sleep(0.05)
            assert len(calls) == 3
            layer.snapshot(source)
            assert len(calls) == 4
        finally:
            await layer.stop()
            await engine.stop()

    run(main())
