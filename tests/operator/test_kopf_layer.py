"""The operator's glue around the pure functions: the work queue, EPP addressing by pod IP, API paths."""

import threading
import time

import pytest

from kvgate.common.envoy_config import PoolBackend
from kvgate.operator.apply import _no_empty_messages, kind_of, summarize_status
from kvgate.operator.epp_pod_address import epp_backend_via_pod
from kvgate.operator.workqueue import WorkQueue
from tests.builders import pod


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


SERVICE = {"spec": {"selector": {"app": "epp"}, "ports": [
    {"name": "grpc", "port": 9002, "targetPort": "grpc"}, {"name": "health", "port": 9003, "targetPort": 9003}]}}


def test_epp_backend_via_pod_uses_every_ready_pod_and_its_target_ports():
    backend = PoolBackend("ns-p", "p-epp.ns.svc.cluster.local", 9002, [], epp_health_port=9003)
    deleting = pod("d", "127.1.0.4", {"app": "epp"}, deleting=True, ports=[("grpc", 19002)])
    pods = [pod("b", "127.1.0.2", {"app": "epp"}, ports=[("grpc", 19002)]),
            pod("a", "127.1.0.1", {"app": "epp"}, ready=False, ports=[("grpc", 19002)]),
            pod("c", "127.1.0.3", {"app": "other"}, ports=[("grpc", 19002)]),
            pod("e", "127.1.0.5", {"app": "epp"}, ports=[("grpc", 19002)]), deleting]
    swapped = epp_backend_via_pod(backend, SERVICE, pods)
    # a rollout's old and new pods both (not one of them, by name): the cluster's hosts change, not the cluster
    assert swapped.epp_pods == (("127.1.0.2", 19002, 9003), ("127.1.0.5", 19002, 9003))
    assert (swapped.epp_host, swapped.epp_port) == (backend.epp_host, backend.epp_port)
    # no Service: the DNS name stays; no ready pod: no host (not the DNS name, which would change the cluster)
    assert epp_backend_via_pod(backend, None, pods) == backend
    assert epp_backend_via_pod(backend, SERVICE, pods[1:3]).epp_pods == ()


def test_api_paths_and_status_helpers():
    deploy = kind_of("apps/v1", "Deployment")
    assert deploy.path("ns", "x", "status") == "/apis/apps/v1/namespaces/ns/deployments/x/status"
    assert kind_of("v1", "Pod").path("ns") == "/api/v1/namespaces/ns/pods"
    fixed = _no_empty_messages({"conditions": [{"type": "Accepted", "status": "True", "reason": "Accepted",
                                                "message": ""}]})
    assert fixed["conditions"][0]["message"] == "Accepted"
    assert summarize_status({"conditions": [{"type": "Ready", "status": "True"}], "readyReplicas": 2,
                             "replicas": 2}) == "Ready=True; ready 2/2"


# --- what wakes a pool: routes, Gateways, labelled ConfigMaps, the operator's own objects ---------------------

def _route(name, pools, gateways, ns="default"):
    return {"metadata": {"name": name, "namespace": ns},
            "spec": {"parentRefs": [{"name": gw} for gw in gateways],
                     "rules": [{"backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                                 "name": pool} for pool in pools]}]}}


def test_route_index_wakes_pools_a_route_references_or_stopped_referencing():
    from kvgate.operator.watches import RouteIndex

    index = RouteIndex()
    assert index.update(("default", "r"), _route("r", ["a"], ["gw"])) == {("default", "a")}
    # the route moves from pool a to pool b: both pools' policies change
    assert index.update(("default", "r"), _route("r", ["b"], ["gw"])) == {("default", "a"), ("default", "b")}
    index.update(("default", "s"), _route("s", ["c"], ["gw", "other"]))
    assert index.pools_behind(("default", "gw")) == {("default", "b"), ("default", "c")}
    assert index.pools_behind(("default", "other")) == {("default", "c")}
    assert index.update(("default", "s"), None) == {("default", "c")}  # deleted: its pool loses the Gateways
    assert index.pools_behind(("default", "other")) == set()


def _registered(network_policy=True):
    import kopf

    from kvgate.operator.config import OperatorConfig
    from kvgate.operator.reconciler import Reconciler
    from kvgate.operator.watches import register

    reconciler = Reconciler(kube=None, config=OperatorConfig("e", "p", "v", network_policy=network_policy))
    registry = register(kopf.OperatorRegistry(), reconciler)
    handlers = {h.selector.plural or h.selector.any_name: h for h in registry._watching.get_all_handlers()}
    return reconciler.queue, handlers


def _drain(q):
    q.add(("end",))
    out = []
    while (key := q.get()) != ("end",):
        out.append(key)
    return out


def test_handlers_enqueue_the_pools_behind_routes_gateways_and_configmaps():
    q, handlers = _registered()
    route = _route("r", ["pool-a"], ["gw"])
    handlers["httproutes"].fn(event={"type": "ADDED"}, body=route, namespace="default", name="r")
    assert _drain(q) == [("Gateways",), ("InferencePool", "default", "pool-a")]
    handlers["gateways"].fn(namespace="default", name="gw")
    assert _drain(q) == [("Gateways",), ("InferencePool", "default", "pool-a")]
    handlers["httproutes"].fn(event={"type": "DELETED"}, body=route, namespace="default", name="r")
    assert _drain(q) == [("Gateways",), ("InferencePool", "default", "pool-a")]
    handlers["gateways"].fn(namespace="default", name="gw")
    assert _drain(q) == [("Gateways",)]
    handlers["configmaps"].fn(namespace="default", name="tuned")
    assert _drain(q) == [("ConfigUsers", "default", "tuned")]
    policy = {"metadata": {"ownerReferences": [{"kind": "InferencePool", "name": "pool-a"}]}}
    handlers["networkpolicies"].fn(body=policy, namespace="default")
    assert _drain(q) == [("InferencePool", "default", "pool-a"), ("Gateways",)]


def test_watches_of_other_peoples_objects_are_filtered_by_the_api_server():
    """kopf's handler label filters run in the operator after the object was sent; these go to the API server."""
    import kopf
    from kopf._cogs.structs.references import Resource

    from kvgate.operator.watches import SERVER_SIDE_SELECTORS

    _, handlers = _registered()
    settings = kopf.OperatorSettings()
    for resource, selector in SERVER_SIDE_SELECTORS.items():
        settings.watching.label_selectors[resource] = selector
    for plural, group, kind in (("deployments", "apps", "Deployment"), ("services", "", "Service"),
                                ("networkpolicies", "networking.k8s.io", "NetworkPolicy"),
                                ("configmaps", "", "ConfigMap")):
        (label,) = handlers[plural].labels  # the handler's own filter ...
        resource = Resource(group=group, version="v1", plural=plural, kind=kind, namespaced=True)
        (selector,) = settings.watching.label_selectors.collect(resource)
        assert selector.split("=")[0] == label  # ... is the one the API server applies
    for plural, group in (("pods", ""), ("secrets", "")):
        resource = Resource(group=group, version="v1", plural=plural, kind="X", namespaced=True)
        assert settings.watching.label_selectors.collect(resource) == []


def test_no_network_policy_watch_when_policies_are_off():
    _, handlers = _registered(network_policy=False)
    assert "networkpolicies" not in handlers and "configmaps" in handlers


def test_the_reactor_is_started_again_when_it_ends_on_its_own():
    """kopf ends its reactor when a watch fails for good (a 404 while a restarted API server registers its CRDs):
    the operator starts it again, with a growing delay, until it is told to stop."""
    import threading

    from kvgate.operator.main import serve_until_stopped

    stop = threading.Event()
    runs = []

    def serve_once():
        runs.append(1)
        if len(runs) == 2:
            raise RuntimeError("404 page not found")
        if len(runs) == 4:
            stop.set()  # SIGTERM while serving: no restart after this run

    assert serve_until_stopped(serve_once, stop, backoff=(0.01, 0.02)) == 3 and len(runs) == 4
    assert serve_until_stopped(serve_once, stop) == 0 and len(runs) == 4  # stopped before: never runs


def test_a_reactor_that_does_not_return_after_its_cleanup_is_left_behind():
    """kopf.run can hang after its cleanup (a watch retrying a request): the operator does not wait for it beyond
    the grace period, so serve_until_stopped can start a fresh reactor; a reactor that returns, or raises, is
    waited for as before."""
    from kvgate.operator.main import run_reactor

    cleaned, release = threading.Event(), threading.Event()

    def hangs_after_cleanup():
        cleaned.set()
        release.wait(30)

    t0 = time.monotonic()
    run_reactor(hangs_after_cleanup, cleaned, grace_s=0.3)
    assert 0.3 <= time.monotonic() - t0 < 5
    release.set()

    def fails():
        raise RuntimeError("404 page not found")

    with pytest.raises(RuntimeError, match="404"):
        run_reactor(fails, threading.Event(), grace_s=0.3)
    long_running = threading.Event()
    run_reactor(lambda: time.sleep(0.5), long_running, grace_s=0.1)  # no cleanup yet: waited for however long
