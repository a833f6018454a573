"""Real server processes for tests: free loopback ports, bounded waits, always stopped."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvgate.common.processes import free_port, stop_group

KVGATE = str(Path(sys.executable).parent / "kvgate")
__all__ = ["KVGATE", "KvgateServe", "free_port", "scrape", "stop_group"]


class KvgateServe:
    """`kvgate serve ...` in its own process group on a free loopback port."""

    def __init__(self, model: str, *args: str, cache_dir: Path | None = None, host: str = "127.0.0.1",
                 port: int | None = None, startup_timeout: float = 120.0, env: dict | None = None) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
        if cache_dir is not None:
            env["KVGATE_CACHE_DIR"] = str(cache_dir)
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvgate-serve-{self.port}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([KVGATE, "serve", model, "--host", host, "--port", str(self.port), *args],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.startup_timeout = startup_timeout

    def wait_ready(self) -> "KvgateServe":
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvgate serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"kvgate serve not healthy in {self.startup_timeout}s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        stop_group(self.proc)
        self._log.close()

    def __enter__(self) -> "KvgateServe":
        return self.wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()


def scrape(url: str) -> dict[str, float]:
    """`/metrics` as {name{labels}: value}, parsed by prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=5.0).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out
