"""The EPP's /metrics under load, through a real gateway: Envoy + `kvgate epp` + 3 sim engines."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import httpx
import pytest

from tests.gateway import Gateway

pytestmark = pytest.mark.processes

STREAMS = 200


def test_epp_metrics_scraped_every_10ms_during_200_concurrent_streams(tmp_path):
    """No scrape error and no exception in the EPP's log."""
    (tmp_path / "logs").mkdir()
    with Gateway(tmp_path / "logs", tmp_path / "cache", [["--backend", "sim"]] * 3) as gw:
        metrics_url = f"http://127.0.0.1:{gw.epp.metrics_port}/metrics"
        scrapes, failures, stop = [], [], threading.Event()

        def scrape_every_10ms() -> None:
            with httpx.Client(timeout=5) as client:
                while not stop.is_set():
                    started = time.monotonic()
                    try:
                        r = client.get(metrics_url)
                        if r.status_code != 200 or "kvgate_epp_endpoint_stale" not in r.text:
                            failures.append(f"HTTP {r.status_code}: {r.text[:300]}")
                        else:
                            scrapes.append(r.text)
                    except httpx.HTTPError as e:
                        failures.append(repr(e))
                    stop.wait(max(0.0, 0.01 - (time.monotonic() - started)))

        async def streams() -> list[tuple[int, int]]:
            limits = httpx.Limits(max_connections=STREAMS, max_keepalive_connections=STREAMS)
            async with httpx.AsyncClient(timeout=120, limits=limits) as client:
                async def one(i: int) -> tuple[int, int]:
                    body = {"model": "sim-model", "prompt": f"stream {i} " + "x" * (i % 50), "stream": True,
                            "max_tokens": 16 + i % 17, "ignore_eos": True}
                    chunks = 0
                    async with client.stream("POST", gw.url + "/v1/completions", json=body) as r:
                        async for line in r.aiter_lines():
                            chunks += line.startswith("data: {")
                    return r.status_code, chunks

                return await asyncio.gather(*(one(i) for i in range(STREAMS)))

        thread = threading.Thread(target=scrape_every_10ms, daemon=True)
        thread.start()
        try:
            results = asyncio.run(asyncio.wait_for(streams(), 180))
        finally:
            stop.set()
            thread.join(10)
        assert [status for status, _ in results] == [200] * STREAMS
        assert all(chunks >= 16 for _, chunks in results)
        print("scrapes", len(scrapes), "failures", len(failures))
        assert not failures, failures[:3]
        assert len(scrapes) >= 20
        # The exporter saw the load: in-flight requests on some endpoint during the run.
        flights = [float(v) for text in scrapes
                   for v in re.findall(r"^kvgate_epp_endpoint_in_flight_requests\{[^}]*\} (\S+)$", text, re.M)]
        assert max(flights) > 0
        tokens = re.findall(r'^kvgate_epp_tokens_total\{endpoint="([^"]+)",kind="completion"\} (\S+)$',
                            gw.epp.metrics(), re.M)
        assert {endpoint for endpoint, _ in tokens} <= set(gw.endpoints)
        log = gw.epp.log_path.read_text(errors="replace")
        assert "Traceback" not in log and "Exception" not in log and "exception" not in log, log[-3000:]
