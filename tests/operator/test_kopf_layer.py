"""The operator's glue around the pure functions: the work queue, EPP addressing by pod IP, API paths."""

import threading
import time

from kvgate.envoy_config import PoolBackend
from kvgate.operator.apply import _no_empty_messages, kind_of, summarize_status
from kvgate.operator.handlers import WorkQueue, epp_backend_via_pod


def test_work_queue_deduplicates_waiting_keys_and_keeps_order():
    q = WorkQueue()
    for key in [("a",), ("b",), ("a",), ("c",), ("b",)]:
        q.add(key)
    assert [q.get(), q.get(), q.get()] == [("a",), ("b",), ("c",)]
    q.add(("a",))  # taken keys can be queued again
    assert q.get() == ("a",)


def test_work_queue_delays_retries_and_stops():
    q = WorkQueue()
    q.add(("later",), delay_s=0.2)
    q.add(("now",))
    start = time.monotonic()
    assert q.get() == ("now",)
    assert q.get() == ("later",) and time.monotonic() - start >= 0.19
    got = []
    consumer = threading.Thread(target=lambda: got.append(q.get()))
    consumer.start()
    q.stop()
    consumer.join(timeout=5)
    assert got == [None] and not consumer.is_alive()


def pod(name, ip, labels, ready=True, ports=()):
    return {"metadata": {"name": name, "labels": labels},
            "spec": {"containers": [{"name": "epp", "ports": [{"name": n, "containerPort": p} for n, p in ports]}]},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


SERVICE = {"spec": {"selector": {"app": "epp"}, "ports": [
    {"name": "grpc", "port": 9002, "targetPort": "grpc"}, {"name": "health", "port": 9003, "targetPort": 9003}]}}


def test_epp_backend_via_pod_uses_a_ready_pod_and_its_target_ports():
    backend = PoolBackend("ns-p", "p-epp.ns.svc.cluster.local", 9002, [], epp_health_port=9003)
    pods = [pod("b", "127.1.0.2", {"app": "epp"}, ports=[("grpc", 19002)]),
            pod("a", "127.1.0.1", {"app": "epp"}, ready=False, ports=[("grpc", 19002)]),
            pod("c", "127.1.0.3", {"app": "other"}, ports=[("grpc", 19002)])]
    swapped = epp_backend_via_pod(backend, SERVICE, pods)
    assert (swapped.epp_host, swapped.epp_port, swapped.epp_health_port) == ("127.1.0.2", 19002, 9003)
    # no Service or no ready pod: the DNS name stays
    assert epp_backend_via_pod(backend, None, pods) == backend
    assert epp_backend_via_pod(backend, SERVICE, pods[1:]) == backend


def test_api_paths_and_status_helpers():
    deploy = kind_of("apps/v1", "Deployment")
    assert deploy.path("ns", "x", "status") == "/apis/apps/v1/namespaces/ns/deployments/x/status"
    assert kind_of("v1", "Pod").path("ns") == "/api/v1/namespaces/ns/pods"
    fixed = _no_empty_messages({"conditions": [{"type": "Accepted", "status": "True", "reason": "Accepted",
                                                "message": ""}]})
    assert fixed["conditions"][0]["message"] == "Accepted"
    assert summarize_status({"conditions": [{"type": "Ready", "status": "True"}], "readyReplicas": 2,
                             "replicas": 2}) == "Ready=True; ready 2/2"
