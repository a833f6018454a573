"""The ported tests: Gateway API Inference Extension conformance, one function per upstream test.

Each names the upstream test (ShortName), applies that test's upstream manifest, and asserts what upstream
asserts: statuses through the helpers in checks.py, traffic through the Gateway's address with the echo
backends saying which pod (and port) served. Where a test depends on a value upstream's Go constants hold,
the constant is restated in resources.py or here.
"""

from __future__ import annotations

import math
import time

from kvgate.conformance import resources as res
from kvgate.conformance.checks import (expect, pods_with_labels, pool_must_be_accepted_by, pool_must_have_condition,
                                       pool_must_have_no_parents, pool_must_have_one_of,
                                       route_must_be_accepted_and_resolved, route_must_have_condition, send_many,
                                       traffic_only_reaches)
from kvgate.conformance.cluster import ConformanceError, wait_until
from kvgate.conformance.suite import Context, conformance_test
from kvgate.conformance.traffic import TEST_ENDPOINT_SELECTION, Request, completion
from kvgate.common.epp_protocol import SERVED_TEST_HEADER

NS = res.APP_BACKEND_NS
SERVED_HEADER = SERVED_TEST_HEADER
MODEL_SERVER_REPLICAS = 3  # upstream's resources.ModelServerPodReplicas
PROMPT_GMO = "Answer with no disclaimers: What are the advantages and disadvantages of genetically modified food?"
PROMPT_SF = "Write as if you were a critic: San Francisco"


def _names_ips(pods: list[dict]) -> tuple[list[str], list[str]]:
    return [p["metadata"]["name"] for p in pods], [p["status"]["podIP"] for p in pods]


# --- statuses ------------------------------------------------------------------------------------------------

@conformance_test("InferencePoolAccepted",
                  "A minimal InferencePool referenced by an HTTPRoute reports Accepted for the Gateway",
                  manifests=("inferencepool_accepted.yaml",))
def inferencepool_accepted(ctx: Context) -> None:
    pool_must_have_condition(ctx, res.PRIMARY_POOL, res.PRIMARY_GATEWAY, "Accepted", "True")


@conformance_test("InferencePoolResolvedRefsCondition",
                  "An InferencePool keeps a parent status per Gateway whose routes use it, routes through both, and "
                  "clears a parent's status (and its route) when the route is deleted",
                  manifests=("inferencepool_resolvedrefs_condition.yaml",))
def inferencepool_resolvedrefs_condition(ctx: Context) -> None:
    primary_route, secondary_route = (NS, "httproute-for-primary-gw"), (NS, "httproute-for-secondary-gw")
    primary = Request(host="primary.example.com", path="/primary-gateway-test")
    secondary = Request(host="secondary.example.com", path="/secondary-gateway-test")
    route_must_be_accepted_and_resolved(ctx, primary_route, res.PRIMARY_GATEWAY)
    route_must_be_accepted_and_resolved(ctx, secondary_route, res.SECONDARY_GATEWAY)

    pool_must_be_accepted_by(ctx, res.PRIMARY_POOL, res.PRIMARY_GATEWAY)
    pool_must_be_accepted_by(ctx, res.PRIMARY_POOL, res.SECONDARY_GATEWAY)
    expect(ctx, res.PRIMARY_GATEWAY, primary, backend=res.PRIMARY_BACKEND)
    expect(ctx, res.SECONDARY_GATEWAY, secondary, backend=res.PRIMARY_BACKEND)

    ctx.cluster.kube.delete(_doc(ctx, "HTTPRoute", primary_route))
    time.sleep(ctx.timing.route_deletion_settle_s)
    pool_must_be_accepted_by(ctx, res.PRIMARY_POOL, res.SECONDARY_GATEWAY)
    expect(ctx, res.SECONDARY_GATEWAY, secondary, backend=res.PRIMARY_BACKEND)
    expect(ctx, res.PRIMARY_GATEWAY, primary, statuses=(404,))

    ctx.cluster.kube.delete(_doc(ctx, "HTTPRoute", secondary_route))
    time.sleep(ctx.timing.route_deletion_settle_s)
    pool_must_have_no_parents(ctx, res.PRIMARY_POOL)
    expect(ctx, res.SECONDARY_GATEWAY, secondary, statuses=(404,))


def _doc(ctx: Context, kind: str, nn: tuple[str, str]) -> dict:
    for doc in ctx.applied:
        if doc["kind"] == kind and (doc["metadata"].get("namespace"), doc["metadata"]["name"]) == nn:
            return doc
    raise ConformanceError(f"{kind} {'/'.join(nn)} is not in this test's manifests")


@conformance_test("InferencePoolInvalidEPPService",
                  "An InferencePool whose endpointPickerRef names a missing Service has ResolvedRefs=False; its "
                  "route stays Accepted and answers 5xx",
                  manifests=("inferencepool_invalid_epp_service.yaml",),
                  features=("SupportGateway", "SupportHTTPRoute", "SupportInferencePool"))
def inferencepool_invalid_epp_service(ctx: Context) -> None:
    route, pool = (NS, "httproute-for-invalid-epp-pool"), (NS, "pool-with-invalid-epp")
    route_must_have_condition(ctx, route, res.PRIMARY_GATEWAY, "Accepted", "True", "Accepted")
    pool_must_have_condition(ctx, pool, res.PRIMARY_GATEWAY, "ResolvedRefs", "False")
    expect(ctx, res.PRIMARY_GATEWAY, Request(host="", path="/invalid-epp-test"), statuses=(500, 501, 502, 503, 504))


@conformance_test("InferencePoolMissingEPPRef",
                  "A route to an InferencePool without endpointPickerRef is Accepted; the pool is Accepted, or "
                  "not Accepted with reason EndpointPickerRefMissing",
                  manifests=("inferencepool_missing_epp_ref.yaml",),
                  features=("SupportGateway", "SupportHTTPRoute", "SupportInferencePool"))
def inferencepool_missing_epp_ref(ctx: Context) -> None:
    route, pool = (NS, "httproute-for-missing-epp-ref-pool"), (NS, "pool-with-missing-epp-ref")
    route_must_have_condition(ctx, route, res.PRIMARY_GATEWAY, "Accepted", "True", "Accepted")
    pool_must_have_one_of(ctx, pool, res.PRIMARY_GATEWAY, [("Accepted", "True", None),
                                                          ("Accepted", "False", "EndpointPickerRefMissing")])


@conformance_test("InferencePoolHTTPRoutePortValidation",
                  "An InferencePool backendRef's port is ignored: unspecified, matching and non-matching ports "
                  "all route to the pool",
                  manifests=("inferencepool_httproute_port_validation.yaml",))
def inferencepool_httproute_port_validation(ctx: Context) -> None:
    for route, host, path in (("httproute-pool-port-unspecified", "port-unspecified.example.com", "/test-port-unspecified"),
                              ("httproute-pool-port-matching", "port-matching.example.com", "/test-port-matching"),
                              ("httproute-pool-port-non-matching", "port-non-matching.example.com",
                               "/test-port-non-matching")):
        route_must_be_accepted_and_resolved(ctx, (NS, route), res.PRIMARY_GATEWAY)
        pool_must_be_accepted_by(ctx, res.PRIMARY_POOL, res.PRIMARY_GATEWAY)
        expect(ctx, res.PRIMARY_GATEWAY, Request(host=host, path=path), backend=res.PRIMARY_BACKEND)


@conformance_test("InferencePoolMultipleRulesDifferentPools",
                  "One HTTPRoute with two rules routes each path to its own InferencePool "
                  "(upstream ShortName HTTPRouteMultipleRulesDifferentPools)",
                  manifests=("inferencepool_multiple_rules_different_pools.yaml",),
                  features=("SupportGateway", "SupportHTTPRoute", "SupportInferencePool"))
def inferencepool_multiple_rules_different_pools(ctx: Context) -> None:
    route = (NS, "httproute-multiple-rules-different-pools")
    route_must_be_accepted_and_resolved(ctx, route, res.PRIMARY_GATEWAY)
    pool_must_be_accepted_by(ctx, res.PRIMARY_POOL, res.PRIMARY_GATEWAY)
    pool_must_be_accepted_by(ctx, res.SECONDARY_POOL, res.PRIMARY_GATEWAY)
    expect(ctx, res.PRIMARY_GATEWAY, Request(host="", path="/primary"), backend="primary-inference-model-server")
    expect(ctx, res.PRIMARY_GATEWAY, Request(host="", path="/secondary"), backend="secondary-inference-model-server")


@conformance_test("HTTPRouteInvalidInferencePoolRef",
                  "An HTTPRoute to an InferencePool that does not exist is Accepted with ResolvedRefs=False "
                  "(BackendNotFound)",
                  manifests=("httproute_invalid_inferencepool_ref.yaml",))
def httproute_invalid_inferencepool_ref(ctx: Context) -> None:
    route = (NS, "httproute-to-non-existent-pool")
    route_must_have_condition(ctx, route, res.PRIMARY_GATEWAY, "Accepted", "True", "Accepted")
    route_must_have_condition(ctx, route, res.PRIMARY_GATEWAY, "ResolvedRefs", "False", "BackendNotFound")


@conformance_test("HTTPRouteMultipleGatewaysDifferentPools",
                  "Two HTTPRoutes on two Gateways route to two InferencePools",
                  manifests=("httproute_multiple_gateways_different_pools.yaml",), features=())
def httproute_multiple_gateways_different_pools(ctx: Context) -> None:
    for route, gateway, pool, host, path, backend in (
            ("route-for-primary-gateway", res.PRIMARY_GATEWAY, res.PRIMARY_POOL, "primary.example.com",
             "/test-primary-gateway", "primary-inference-model-server"),
            ("route-for-secondary-gateway", res.SECONDARY_GATEWAY, res.SECONDARY_POOL, "secondary.example.com",
             "/test-secondary-gateway", "secondary-inference-model-server")):
        route_must_have_condition(ctx, (NS, route), gateway, "Accepted", "True")
        pool_must_be_accepted_by(ctx, pool, gateway)
        expect(ctx, gateway, Request(host=host, path=path), backend=backend)


# --- routing by the EPP --------------------------------------------------------------------------------------

def _pin_each(ctx: Context, gateway, host: str, path: str, names: list[str], endpoints: list[str],
              prompt: str, served_header: bool = False) -> None:
    """A request pinned to each endpoint in turn is served by that pod (and reports it, when asked)."""
    for name, endpoint in zip(names, endpoints):
        expect(ctx, gateway, Request(host=host, path=path, method="POST", body=completion(prompt),
                                     headers={TEST_ENDPOINT_SELECTION: endpoint}),
               backend=name, headers={SERVED_HEADER: endpoint} if served_header else None)


@conformance_test("GatewayFollowingEPPRouting",
                  "The Gateway sends each request to an endpoint in the list the EPP returned",
                  manifests=("gateway_following_epp_routing.yaml",))
def gateway_following_epp_routing(ctx: Context) -> None:
    host, path = "primary.example.com", "/primary-gateway-test"
    route_must_be_accepted_and_resolved(ctx, (NS, "httproute-for-primary-gw"), res.PRIMARY_GATEWAY)
    pool_must_be_accepted_by(ctx, res.PRIMARY_POOL, res.PRIMARY_GATEWAY)
    names, ips = _names_ips(pods_with_labels(ctx, res.PRIMARY_BACKEND_LABELS, MODEL_SERVER_REPLICAS))
    _pin_each(ctx, res.PRIMARY_GATEWAY, host, path, names, ips, PROMPT_GMO)
    for chosen in ([2], [0, 1], [0, 1, 2]):
        req = Request(host=host, path=path, method="POST", body=completion(PROMPT_GMO),
                      headers={TEST_ENDPOINT_SELECTION: ",".join(ips[i] for i in chosen)})
        traffic_only_reaches(ctx, res.PRIMARY_GATEWAY, req, [names[i] for i in chosen], "primary-inference-model-server")


DP_PORTS = ("3000", "3002", "3004")


@conformance_test("GatewayFollowingEPPRoutingWithDataParallelism",
                  "With several targetPorts (data-parallel ranks) the Gateway sends each request to a pod and port "
                  "the EPP selected",
                  manifests=("gateway_following_epp_routing_dp.yaml",))
def gateway_following_epp_routing_dp(ctx: Context) -> None:
    host, path = "primary.example.com", "/primary-gateway-dp-test"
    route_must_be_accepted_and_resolved(ctx, (NS, "httproute-for-primary-gw-dp"), res.PRIMARY_GATEWAY)
    pool_must_be_accepted_by(ctx, res.DP_POOL, res.PRIMARY_GATEWAY)
    names, ips = _names_ips(pods_with_labels(ctx, res.DP_BACKEND_LABELS, 3))
    ip_of = dict(zip(names, ips))
    _pin_each(ctx, res.PRIMARY_GATEWAY, host, path, names, ips, PROMPT_GMO)
    cases = ({ips[1]: ()}, {ips[0]: (), ips[2]: ("3002",)}, {ips[0]: (), ips[1]: ("3000", "3004"), ips[2]: ()})
    for allowed in cases:
        tokens = [tok for ip in sorted(allowed) for tok in ([ip] if not allowed[ip] else
                                                             [f"{ip}:{p}" for p in sorted(allowed[ip])])]
        req = Request(host=host, path=path, method="POST", body=completion(PROMPT_GMO),
                      headers={TEST_ENDPOINT_SELECTION: ",".join(tokens)})
        expected = [n for n in names if ip_of[n] in allowed]
        for r in traffic_only_reaches(ctx, res.PRIMARY_GATEWAY, req, expected, "dp-inference-model-server"):
            port = str(r.echo.get("httpPort", ""))
            if not port:
                raise ConformanceError("missing httpPort in the echo response")
            ports = allowed[ip_of[r.pod]] or DP_PORTS
            if port not in ports:
                raise ConformanceError(f"unexpected port {port} for pod {r.pod} (allowed: {list(ports)})")


@conformance_test("GatewayDestinationEndpointServed",
                  "The Gateway reports the endpoint that served each request (x-gateway-destination-endpoint-served "
                  "metadata, echoed by the EPP as x-conformance-test-served-endpoint)",
                  manifests=("gateway_destination_endpoint_served.yaml",))
def gateway_destination_endpoint_served(ctx: Context) -> None:
    route_must_be_accepted_and_resolved(ctx, (NS, "httproute-for-destination-endpoint-served"), res.PRIMARY_GATEWAY)
    pool_must_be_accepted_by(ctx, res.PRIMARY_POOL, res.PRIMARY_GATEWAY)
    names, ips = _names_ips(pods_with_labels(ctx, res.PRIMARY_BACKEND_LABELS, MODEL_SERVER_REPLICAS))
    _pin_each(ctx, res.PRIMARY_GATEWAY, "primary.example.com", "/destination-endpoint-served-test", names,
              [f"{ip}:3000" for ip in ips], PROMPT_SF, served_header=True)


@conformance_test("EppUnavailableFailOpen",
                  "With failureMode FailOpen the Gateway keeps serving the pool while its EPP is unavailable",
                  manifests=("epp_unavailable_fail_open.yaml",))
def epp_unavailable_fail_open(ctx: Context) -> None:
    host, path = "secondary.example.com", "/failopen-pool-test"
    route_must_be_accepted_and_resolved(ctx, (NS, "httproute-for-failopen-pool-gw"), res.SECONDARY_GATEWAY)
    pool_must_be_accepted_by(ctx, res.SECONDARY_POOL, res.SECONDARY_GATEWAY)
    names, ips = _names_ips(pods_with_labels(ctx, res.SECONDARY_BACKEND_LABELS, MODEL_SERVER_REPLICAS))
    req = Request(host=host, path=path, method="POST", body=completion(PROMPT_GMO),
                  headers={TEST_ENDPOINT_SELECTION: ips[0]})
    expect(ctx, res.SECONDARY_GATEWAY, req, backend=names[0])
    # Make the pool's EPP Service unavailable (a selector that matches nothing), as upstream does, and restore it.
    service = ctx.cluster.get(res.SERVICE, res.SECONDARY_EPP_SERVICE, NS)
    if service is None:
        raise ConformanceError(f"Service {NS}/{res.SECONDARY_EPP_SERVICE} not found")
    selector = service["spec"].get("selector") or {}
    patch = {"spec": {"selector": {k: None for k in selector} | {"kvgate-conformance/unavailable": "true"}}}
    path_ = res.SERVICE.path(NS, res.SECONDARY_EPP_SERVICE)
    ctx.cluster.kube.request("PATCH", path_, patch, content_type="application/merge-patch+json")
    try:
        ctx.say(f"EPP Service {res.SECONDARY_EPP_SERVICE} made unavailable")
        expect(ctx, res.SECONDARY_GATEWAY, req, backend="secondary-inference-model-server")
    finally:
        restore = {"spec": {"selector": {"kvgate-conformance/unavailable": None, **selector}}}
        ctx.cluster.kube.request("PATCH", path_, restore, content_type="application/merge-patch+json")


@conformance_test("GatewayWeightedAcrossTwoInferencePools",
                  "A rule with weighted backendRefs to two InferencePools splits traffic by weight (70/30) and each "
                  "request reaches an endpoint of the pool it was sent to",
                  manifests=("gateway_weighted_two_pools.yaml",))
def gateway_weighted_two_pools(ctx: Context) -> None:
    host, path, total, concurrency, primary_weight, secondary_weight = (
        "primary.example.com", "/weighted-two-pools-test", 200, 5, 70, 30)
    route_must_be_accepted_and_resolved(ctx, (NS, "httproute-weighted-two-pools"), res.PRIMARY_GATEWAY)
    pool_must_be_accepted_by(ctx, res.PRIMARY_POOL, res.PRIMARY_GATEWAY)
    pool_must_be_accepted_by(ctx, res.SECONDARY_POOL, res.PRIMARY_GATEWAY)
    primary_names, primary_ips = _names_ips(pods_with_labels(ctx, res.PRIMARY_BACKEND_LABELS, 3))
    secondary_names, secondary_ips = _names_ips(pods_with_labels(ctx, res.SECONDARY_BACKEND_LABELS, 3))
    selection = {TEST_ENDPOINT_SELECTION: ",".join(primary_ips + secondary_ips)}
    expect(ctx, res.PRIMARY_GATEWAY, Request(host=host, path=path, method="POST", headers=selection,
                                             body=completion("Warmup")), namespace=NS)
    req = Request(host=host, path=path, method="POST", headers=selection, body=completion(PROMPT_SF))
    responses = send_many(ctx, res.PRIMARY_GATEWAY, req, total, concurrency)
    hits = {"primary": 0, "secondary": 0}
    for r in responses:
        if r.status != 200:
            raise ConformanceError(f"request failed: {r.describe()}")
        if r.pod in primary_names:
            hits["primary"] += 1
        elif r.pod in secondary_names:
            hits["secondary"] += 1
        else:
            raise ConformanceError(f"request was handled by unexpected pod {r.pod!r} (not in either pool)")
    observed = hits["primary"] / total
    expected = primary_weight / (primary_weight + secondary_weight)
    tolerance = max(0.10, 3.0 * math.sqrt(expected * (1 - expected) / total))
    ctx.say(f"weighted split: primary {hits['primary']}/{total} = {observed:.3f}, expected {expected:.3f} "
            f"± {tolerance:.3f}")
    if abs(observed - expected) > tolerance:
        raise ConformanceError(f"weighted split out of bounds: observed primary={observed:.3f} "
                               f"({hits['primary']}/{total}), expected={expected:.3f}, tolerance=±{tolerance:.3f}")


@conformance_test("InferencePoolAppProtocol",
                  "An InferencePool's appProtocol is honoured (kubernetes.io/h2c: cleartext HTTP/2 to the model "
                  "servers) and HTTP/1.1 is the default",
                  manifests=("inferencepool_appprotocol.yaml",))
def inferencepool_appprotocol(ctx: Context) -> None:
    cases = (("appprotocol-h2c.example.com", "/inferencepool-app-protocol-h2c", "3001",
              "httproute-for-inferencepool-appprotocol-h2c", res.APPPROTOCOL_H2C_POOL, res.APPPROTOCOL_BACKEND_LABELS),
             ("appprotocol-http.example.com", "/inferencepool-app-protocol-http", "3000",
              "httproute-for-inferencepool-appprotocol-http", res.APPPROTOCOL_HTTP_POOL,
              res.APPPROTOCOL_BACKEND_LABELS),
             ("appprotocol-default.example.com", "/inferencepool-app-protocol-default", "3000",
              "httproute-for-inferencepool-appprotocol-default", res.PRIMARY_POOL, res.PRIMARY_BACKEND_LABELS))
    for host, path, port, route, pool, labels in cases:
        route_must_be_accepted_and_resolved(ctx, (NS, route), res.PRIMARY_GATEWAY)
        pool_must_be_accepted_by(ctx, pool, res.PRIMARY_GATEWAY)
        pods = wait_until(lambda: ctx.cluster.ready_pods(NS, labels), ctx.timing.pods_ready_s,
                          f"ready pods with labels {labels}")
        names, ips = _names_ips(sorted(pods, key=lambda p: p["metadata"]["name"]))
        _pin_each(ctx, res.PRIMARY_GATEWAY, host, path, names, [f"{ip}:{port}" for ip in ips],
                  "Describe San Francisco in one sentence.", served_header=True)
