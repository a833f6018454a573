"""A real gateway for tests: sim (or demo) engines + `kvgate epp` + Envoy, each its own process."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Callable

import httpx

from kvgate.common.envoy_config import PoolBackend, envoy_binary
from kvgate.common.gateway_routes import render_pool_gateway
from kvgate.common.processes import wait_http_ok
from tests.procs import KVGATE, KvgateServe, free_port, stop_group


class Proc:
    def __init__(self, name: str, cmd: list[str], logdir: Path) -> None:
        self.name = name
        self.log_path = logdir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=dict(os.environ, OMP_NUM_THREADS="1"))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        stop_group(self.proc)
        self._log.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]


def wait_http(url: str, proc: Proc | None, timeout: float = 60.0) -> None:
    def problem():
        return None if proc is None or proc.alive() else f"{proc.name} died:\n{proc.log()}"

    wait_http_ok(url, timeout, problem, url)


class EPP(Proc):
    """`kvgate epp`, returned once it reports ready (as a Deployment's readiness gate and Envoy's health check
    would wait: the EPP turns ready once it can route, at most 2 s after its endpoints are known)."""

    def __init__(self, logdir: Path, endpoints: list[str] | None = None, endpoints_file: Path | None = None,
                 extra: list[str] = (), wait_ready: bool = True) -> None:
        self.grpc_port, self.health_port, self.metrics_port = free_port(), free_port(), free_port()
        cmd = [KVGATE, "epp", "--grpc-port", str(self.grpc_port), "--grpc-health-port", str(self.health_port),
               "--metrics-port", str(self.metrics_port), *extra]
        cmd += ["--endpoints-file", str(endpoints_file)] if endpoints_file else ["--endpoints", ",".join(endpoints)]
        super().__init__("epp", cmd, logdir)
        wait_http(f"http://127.0.0.1:{self.metrics_port}/metrics", self)
        if wait_ready:
            self.wait_ready()

    def ready(self) -> bool:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(f"127.0.0.1:{self.health_port}") as channel:
            try:
                status = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="readiness"), timeout=2).status
            except grpc.RpcError:
                return False
        return status == health_pb2.HealthCheckResponse.SERVING

    def wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready():
            if not self.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the EPP never turned ready:\n{self.log()}")
            time.sleep(0.05)

    def metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text


class Envoy(Proc):
    def __init__(self, logdir: Path, config: dict, admin_port: int, name: str = "envoy") -> None:
        path = logdir / f"{name}.json"
        path.write_text(json.dumps(config))
        super().__init__(name, [envoy_binary(), "-c", str(path), "--log-level", "warn",
                                "--base-id", str(admin_port)], logdir)
        wait_http(f"http://127.0.0.1:{admin_port}/ready", self)


class Gateway:
    """N engines, an EPP over them, an Envoy in front: `url` is what clients call."""

    def __init__(self, logdir: Path, cache_dir: Path, engine_args: list[list[str]], *, failure_mode_allow=False,
                 epp_args: list[str] = (), model: str = "sim-model",
                 envoy_config: Callable[[PoolBackend, int, int], dict] | None = None) -> None:
        """`envoy_config(pool, port, admin_port)` renders Envoy's config (default: kvgate's, `render_pool_gateway`)."""
        self.logdir = logdir
        self.engines: list[KvgateServe] = []
        self.epp = self.envoy = None
        try:
            for args in engine_args:
                self.engines.append(KvgateServe(model, *args, cache_dir=cache_dir))
            for e in self.engines:
                e.wait_ready()
            self.endpoints = [f"127.0.0.1:{e.port}" for e in self.engines]
            self.epp = EPP(logdir, self.endpoints, extra=list(epp_args))
            self.port, self.admin_port = free_port(), free_port()
            pool = PoolBackend("test", "127.0.0.1", self.epp.grpc_port, self.endpoints, failure_mode_allow,
                               epp_health_port=self.epp.health_port)
            render = envoy_config or (lambda p, port, admin: render_pool_gateway(p, "127.0.0.1", port, admin))
            self.envoy = Envoy(logdir, render(pool, self.port, self.admin_port), self.admin_port)
            self.url = f"http://127.0.0.1:{self.port}"
            self._wait_epp_sees_metrics()
        except BaseException:
            self.stop()
            raise

    def _wait_epp_sees_metrics(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.epp.metrics()
            fresh = [l for l in text.splitlines() if l.startswith("kvgate_epp_endpoint_stale") and l.endswith(" 0.0")]
            if len(fresh) == len(self.endpoints):
                return
            time.sleep(0.1)
        raise TimeoutError(f"EPP never saw fresh metrics:\n{self.epp.log()}")

    def envoy_stat(self, name: str) -> int:
        text = httpx.get(f"http://127.0.0.1:{self.admin_port}/stats?filter=^{name}$", timeout=5).text
        return int(text.split(":")[1]) if ":" in text else 0

    def stop(self) -> None:
        for p in (self.envoy, self.epp):
            if p is not None:
                p.stop()
        for e in self.engines:
            e.stop()

    def __enter__(self) -> "Gateway":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
