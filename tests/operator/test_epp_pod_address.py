"""`--epp-address-mode pod-ip` over a whole routing (epp_pod_address.routing_via_epp_pods): only pool backends
change, each EPP Service's namespace is listed once, and a route's other fields stay as they were."""

from kvgate.common.envoy_config import PoolBackend
from kvgate.common.gateway_routes import RouteRule, ServiceBackend, WeightedBackend
from kvgate.operator.epp_pod_address import routing_via_epp_pods
from kvgate.operator.gateway import GatewayRouting
from tests.builders import pod


def _epp_service(name, ns):
    return {"metadata": {"name": name, "namespace": ns},
            "spec": {"selector": {"app": name}, "ports": [{"port": 9002, "targetPort": 19002}]}}


def test_routing_via_epp_pods_swaps_pool_backends_only():
    pool = PoolBackend("ns-p", "p-epp.ns.svc.cluster.local", 9002, [])
    other = PoolBackend("other-q", "q-epp.other.svc.cluster.local", 9002, [])
    service = ServiceBackend("ns-echo-80", "echo.ns.svc.cluster.local", 80)
    rules = [RouteRule("ns/r/0", 80, [WeightedBackend(pool, 3), WeightedBackend(service)], path_value="/v1"),
             RouteRule("ns/r/1", 80, [WeightedBackend(pool), WeightedBackend(other), WeightedBackend(None)])]
    routing = GatewayRouting(rules, {("ns", "r"): []}, [("ns", "p")], {"http": 1})
    listed = []

    def pods_of(ns):
        listed.append(ns)
        return {"ns": [pod("p-epp-1", "10.0.0.1", {"app": "p-epp"})], "other": []}[ns]

    swapped = routing_via_epp_pods(routing, [_epp_service("p-epp", "ns"), _epp_service("q-epp", "other")], pods_of)
    first, second = swapped.rules
    assert first.backends[0].backend.epp_pods == (("10.0.0.1", 19002, None),) and first.backends[0].weight == 3
    assert first.backends[1].backend is service and first.path_value == "/v1"
    assert second.backends[0].backend == first.backends[0].backend
    assert second.backends[1].backend.epp_pods == () and second.backends[2].backend is None  # no ready pod: none
    assert sorted(listed) == ["ns", "other"]  # once per backend, not per rule
    assert swapped[1:] == routing[1:] and routing.rules[0].backends[0].backend is pool  # the input is unchanged
