"""The conformance port's pure parts: manifests, their preparation, selection, checks and the report.

The suite itself runs against the e2e rig (tests/e2e/test_conformance_e2e.py)."""

from pathlib import Path

import pytest
import yaml

from kvgate.conformance import resources as res
from kvgate.conformance.epp_config import CONFORMANCE_EPP_CONFIG
from kvgate.epp.scheduling.config import load_config
from kvgate.conformance.cluster import ConformanceError, load_manifest, parent_entry, prepare
from kvgate.conformance.checks import response_check
from kvgate.conformance.suite import TESTS, Options, Result, report, selected
from kvgate.conformance.traffic import Response

PACKAGED = Path(__file__).resolve().parents[1] / "conformance" / "manifests"
ISSUE_TESTS = {"InferencePoolAccepted", "InferencePoolResolvedRefsCondition", "InferencePoolInvalidEPPService",
               "InferencePoolMissingEPPRef", "InferencePoolHTTPRoutePortValidation",
               "InferencePoolMultipleRulesDifferentPools", "HTTPRouteInvalidInferencePoolRef",
               "HTTPRouteMultipleGatewaysDifferentPools", "GatewayFollowingEPPRouting",
               "GatewayFollowingEPPRoutingWithDataParallelism", "GatewayDestinationEndpointServed",
               "EppUnavailableFailOpen", "GatewayWeightedAcrossTwoInferencePools", "InferencePoolAppProtocol"}


def all_tests():
    selected(Options(gateway_class="x"))  # imports the cases
    return {t.short_name: t for t in TESTS}


def test_every_issue_test_is_ported_and_its_manifests_exist():
    tests = all_tests()
    assert set(tests) == ISSUE_TESTS
    for t in tests.values():
        for m in t.manifests:
            assert load_manifest(m), m


def test_prepare_substitutes_class_and_epp_image_and_probes():
    docs = load_manifest("base.yaml")
    gateways = [prepare(d, "kvgate-x", None, True) for d in docs if d["kind"] == "Gateway"]
    assert {g["spec"]["gatewayClassName"] for g in gateways} == {"kvgate-x"}
    epp = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == res.PRIMARY_EPP)
    unchanged = prepare(epp, "kvgate-x", None, True)
    assert unchanged == epp  # no EPP image given, gRPC probes supported: the upstream document as it is
    ours = prepare(epp, "kvgate-x", "ghcr.io/kvgate/kvgate:latest", grpc_probes=False)
    c = ours["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == "ghcr.io/kvgate/kvgate:latest" and c["command"] == ["kvgate", "epp"]
    assert c["args"][:2] == ["--pool-name", "primary-inference-pool"]
    # Our EPP on every interface, as upstream's is, and with the conformance plugins its default config lacks.
    assert c["args"][-4:] == ["--grpc-host", "0.0.0.0", "--config-text", CONFORMANCE_EPP_CONFIG]
    assert c["readinessProbe"]["tcpSocket"] == {"port": 9003} and "grpc" not in c["readinessProbe"]
    echo = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == res.PRIMARY_BACKEND)
    assert prepare(echo, "kvgate-x", "ghcr.io/kvgate/kvgate:latest", False)["spec"]["template"]["spec"][
        "containers"][0]["image"] == echo["spec"]["template"]["spec"]["containers"][0]["image"]


def test_our_epp_accepts_the_upstream_epp_arguments():
    from kvgate.cli import build_parser

    epp = next(d for d in load_manifest("base.yaml") if d["kind"] == "Deployment"
               and d["metadata"]["name"] == res.PRIMARY_EPP)
    c = prepare(epp, "x", "kvgate", False)["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args(c["command"][1:] + c["args"])
    assert (args.pool_name, args.pool_namespace, args.grpc_port, args.grpc_health_port, args.grpc_host) == (
        "primary-inference-pool", res.APP_BACKEND_NS, 9002, 9003, "0.0.0.0")
    assert load_config(args.config_file, args.config_text).report_served_endpoint


def test_selection_by_name_and_feature():
    plan = dict((t.short_name, why) for t, why in selected(Options("x", run_tests=("EppUnavailableFailOpen",))))
    assert plan["EppUnavailableFailOpen"] is None and all(w for n, w in plan.items() if n != "EppUnavailableFailOpen")
    plan = dict((t.short_name, why) for t, why in selected(Options("x", skip_tests=("InferencePoolAccepted",))))
    assert plan["InferencePoolAccepted"].startswith("skipped") and plan["GatewayFollowingEPPRouting"] is None
    plan = dict((t.short_name, why) for t, why in selected(Options("x", supported_features=("SupportGateway",
                                                                                              "SupportInferencePool"))))
    assert "SupportHTTPRoute" in plan["InferencePoolInvalidEPPService"] and plan["InferencePoolAccepted"] is None
    with pytest.raises(ValueError, match="NoSuchTest"):
        selected(Options("x", run_tests=("NoSuchTest",)))


def test_parent_entry_matches_gateway_parent_refs():
    pool = {"metadata": {"namespace": "app"}, "status": {"parents": [
        {"parentRef": {"kind": "Gateway", "name": "gw", "namespace": "infra"}, "conditions": [{"type": "Accepted"}]},
        {"parentRef": {"kind": "Gateway", "name": "gw", "namespace": "other"}, "conditions": []}]}}
    assert parent_entry(pool, "infra", "gw")["conditions"] == [{"type": "Accepted"}]
    assert parent_entry(pool, "infra", "nope") is None
    route = {"metadata": {"namespace": "app"}, "status": {"parents": [{"parentRef": {"name": "gw"}, "conditions": []}]}}
    assert parent_entry(route, "app", "gw") is not None  # namespace defaults to the route's


def test_response_check_states_what_was_wrong():
    ok = Response(200, {"x-conformance-test-served-endpoint": "1.2.3.4:3000"},
                  {"pod": "primary-inference-model-server-deployment-abc", "namespace": res.APP_BACKEND_NS}, "")
    assert response_check(backend=res.PRIMARY_BACKEND, headers={"x-conformance-test-served-endpoint": "1.2.3.4:3000"})(ok)
    with pytest.raises(AssertionError, match="served by pod"):
        response_check(backend="secondary")(ok)
    with pytest.raises(AssertionError, match="status 503"):
        response_check()(Response(503, {}, {}, "no"))
    with pytest.raises(AssertionError, match="response header"):
        response_check(headers={"x-conformance-test-served-endpoint": "9.9.9.9:3000"})(ok)
    assert response_check(statuses=(500, 503))(Response(503, {}, {}, ""))  # a 5xx has no echo to check


def test_report_shape_and_counts(tmp_path):
    results = [Result("A", "Passed", 1.0), Result("B", "Failed", 2.0, "timed out"), Result("C", "Skipped", 0, "why")]
    data = report(results, Options("kvgate", implementation={"project": "kvgate"}), "1.20")
    assert data["kind"] == "ConformanceReport" and data["apiVersion"] == "gateway.networking.k8s.io/v1"
    core = data["profiles"][0]["core"]
    assert core["result"] == "failure" and core["statistics"] == {"Passed": 1, "Failed": 1, "Skipped": 1}
    assert core["failedTests"] == ["B"] and core["skippedTests"] == ["C"]
    assert {"name": "B", "result": "Failed", "seconds": 2.0, "reason": "timed out"} in data["tests"]
    assert yaml.safe_load(yaml.safe_dump(data)) == data
    assert report([Result("A", "Passed", 1.0)], Options("k"))["profiles"][0]["core"]["result"] == "success"


def test_conformance_error_is_an_assertion():
    assert issubclass(ConformanceError, AssertionError)
