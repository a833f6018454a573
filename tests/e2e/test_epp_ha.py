"""Two `kvgate epp --ha-enable-leader-election` replicas of one pool against the rig's real API server: the
leader reports ready, the follower is live but NOT_SERVING (the protocol's rule for active-passive), and when the
leader is stopped (SIGTERM: a rollout, a deleted pod) the follower leads and turns ready within about a retry
period, because the leader released its Lease on the way out."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from k8srig import crds
from operator_run import grpc_health, print_log_tail
from test_epp_kubernetes import free_ports

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
KVGATE = str(Path(sys.executable).parent / "kvgate")
TIMINGS = ["--ha-lease-duration", "4s", "--ha-renew-deadline", "3s", "--ha-retry-period", "0.5s"]


def health(port: int, service: str) -> str:
    return grpc_health(f"127.0.0.1:{port}", service)


def test_follower_not_serving_then_leads_when_the_leader_stops(k8s, namespace, tmp_path):
    if not getattr(k8s, "local", False):
        pytest.skip("runs the EPPs as local processes next to the rig")
    crds.install(k8s.client, sorted((REPO / "crds").glob("*.yaml")))
    k8s.client.apply({"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
                      "metadata": {"name": "pool", "namespace": namespace},
                      "spec": {"selector": {"matchLabels": {"app": "llm"}}, "targetPorts": [{"number": 8000}],
                               "endpointPickerRef": {"name": "pool-epp", "port": {"number": 9002}}}})
    replicas = []
    try:
        for i in range(2):
            grpc_port, health_port, metrics_port = free_ports(3)
            log = tmp_path / f"epp{i}.log"
            proc = subprocess.Popen(
                [KVGATE, "--log-level", "info", "epp", "--pool-name", "pool", "--pool-namespace", namespace,
                 "--grpc-port", str(grpc_port), "--grpc-health-port", str(health_port),
                 "--metrics-port", str(metrics_port), "--ha-enable-leader-election", *TIMINGS],
                stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True,
                env=dict(os.environ, KUBECONFIG=str(k8s.kubeconfig), HOSTNAME=f"epp-{i}"))
            replicas.append((proc, health_port, log))

        def states() -> list[str]:
            for proc, _, log in replicas:
                assert proc.poll() is None or proc is stopped, f"an EPP exited:\n{log.read_text()[-3000:]}"
            return [health(port, "readiness") for _, port, _ in replicas]

        stopped = None
        deadline = time.monotonic() + 60
        while sorted(states()) != ["NOT_SERVING", "SERVING"]:
            assert time.monotonic() < deadline, f"never one leader: {states()}"
            time.sleep(0.1)
        time.sleep(1.5)  # three retry periods: the follower keeps trying and stays a follower
        now = states()
        assert sorted(now) == ["NOT_SERVING", "SERVING"], now
        leader = now.index("SERVING")
        follower = 1 - leader
        assert health(replicas[follower][1], "liveness") == "SERVING"  # live, just not leading

        stopped, began = replicas[leader][0], time.monotonic()
        stopped.terminate()  # SIGTERM: release the Lease, then drain
        while health(replicas[follower][1], "readiness") != "SERVING":
            assert time.monotonic() - began < 10, "the follower never took over"
            time.sleep(0.05)
        took = time.monotonic() - began
        print(f"[ha] the follower reported ready {took:.2f}s after the leader got SIGTERM")
        assert took < 3.0, took  # released: one retry period (0.5 s) and the readiness loop, not the 4 s lease
        assert stopped.wait(timeout=30) == 0
    except BaseException:
        for _, _, log in replicas:
            print_log_tail(log, what=log.name)
        raise
    finally:
        for proc, _, _ in replicas:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
