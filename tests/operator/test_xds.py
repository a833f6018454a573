"""The operator's xDS side without a network: the xDS form of a Gateway's config, snapshots and their versions,
the ADS stream's protocol rules (ordering, nonces, ACK/NACK, reconnects), the Envoys' reports and the Gateway's
Programmed condition (operator/xds/)."""

from __future__ import annotations

import copy
import json

import pytest
from envoy.service.discovery.v3.discovery_pb2 import DiscoveryRequest
from google.rpc.status_pb2 import Status

from kvgate.common.envoy_config import EnvoyTracing, PoolBackend
from kvgate.common.gateway_routes import (BOOTSTRAP_FILE, CDS_FILE, RouteRule, ServiceBackend, WeightedBackend,
                                          render_gateway_files)
from kvgate.operator import gateway as g
from kvgate.operator.config import OperatorConfig
from kvgate.operator.failures import PermanentFailureLog
from kvgate.operator.gateway_reconciler import GatewayReconciler
from kvgate.operator.xds import ack_report as acks
from kvgate.operator.xds.ads_stream import MAX_ERROR_CHARS, AdsStream
from kvgate.operator.xds.configmap_source import ConfigMapSource, snapshot_of
from kvgate.operator.xds.snapshot import (CLUSTER, ENDPOINT, LISTENER, ROUTE, Snapshot, SnapshotError,
                                          config_version)
from kvgate.operator.xds.snapshot_cache import SnapshotCache
from kvgate.operator.xds.xds_files import LDS_FILE, XDS_CLUSTER, XdsAddress, xds_files
from tests.operator.memory_kube import MemoryKube

ADDRESS = XdsAddress("kvgate-xds.kvgate-system.svc.cluster.local", 18000)
NODE = "ns/gw"


def _files(weights=(3, 1), service=True, tracing=None):
    fail_open = PoolBackend("open", "epp-open.ns.svc", 9002, ["127.0.0.3:8000"], failure_mode_allow=True,
                            epp_health_port=9003)
    by_pod = PoolBackend("bypod", "epp-bypod.ns.svc", 9002, [], epp_pods=[("10.0.0.9", 9002, 9003)],
                         fallbacks=True)
    rules = [RouteRule("ns/r/0", 8080, [WeightedBackend(fail_open, weights[0]), WeightedBackend(by_pod, weights[1])])]
    if service:
        rules.append(RouteRule("ns/r/1", 8080, [WeightedBackend(ServiceBackend("ns-web-80", "web.ns.svc", 80))],
                               ["a.example.com"], "Exact", "/web"))
    return xds_files(render_gateway_files(rules, [8080], 19000, node_id=NODE, tracing=tracing), ADDRESS)


def test_the_xds_form_keeps_only_the_bootstrap_static():
    files = _files(tracing=EnvoyTracing.from_endpoint("http://otel:4317", 1.0))
    assert sorted(files) == [CDS_FILE, "eds-epp-bypod.yaml", BOOTSTRAP_FILE, LDS_FILE, "rds-8080.yaml"]
    bootstrap = files[BOOTSTRAP_FILE]
    assert "listeners" not in bootstrap["static_resources"]
    assert [c["name"] for c in bootstrap["static_resources"]["clusters"]][-1] == XDS_CLUSTER  # after the collector's
    assert bootstrap["dynamic_resources"]["ads_config"]["grpc_services"] == [{"envoy_grpc": {"cluster_name": XDS_CLUSTER}}]
    assert bootstrap["dynamic_resources"]["cds_config"] == bootstrap["dynamic_resources"]["lds_config"] == {
        "ads": {}, "resource_api_version": "V3"}
    (listener,) = files[LDS_FILE]["resources"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    assert hcm["rds"]["config_source"] == {"ads": {}, "resource_api_version": "V3"} and "tracing" in hcm
    eds = [c for c in files[CDS_FILE]["resources"] if c.get("type") == "EDS"]
    assert eds and all(c["eds_cluster_config"]["eds_config"] == {"ads": {}, "resource_api_version": "V3"} for c in eds)
    assert "path_config_source" not in json.dumps({k: v for k, v in files.items() if k != BOOTSTRAP_FILE})


def test_snapshots_pack_every_resource_and_version_by_type():
    snapshot = Snapshot.from_files(_files())
    assert {t: sorted(r) for t, r in snapshot.resources.items()} == {
        CLUSTER: ["epp-bypod", "epp-open", "pool-bypod", "pool-open", "pool-open-failopen", "svc-ns-web-80"],
        ENDPOINT: ["epp-bypod"], LISTENER: ["gateway-8080"], ROUTE: ["gateway-8080"]}
    assert Snapshot.from_files(_files()).versions == snapshot.versions  # the same input, the same versions
    # A weight change is a route change only; a backend gone changes the clusters too.
    weights = Snapshot.from_files(_files(weights=(1, 3)))
    assert {t for t in snapshot.versions if weights.versions[t] != snapshot.versions[t]} == {ROUTE}
    assert weights.version != snapshot.version
    fewer = Snapshot.from_files(_files(service=False))
    assert {t for t in snapshot.versions if fewer.versions[t] != snapshot.versions[t]} == {CLUSTER, ROUTE}
    assert snapshot.select(ROUTE, ["gateway-8080", "nope"]) == [snapshot.resources[ROUTE]["gateway-8080"]]


def test_a_resource_envoy_s_protos_do_not_take_is_refused():
    files = _files()
    files[CDS_FILE]["resources"][0]["no_such_field"] = 1
    with pytest.raises(SnapshotError, match="no_such_field"):
        Snapshot.from_files(files)
    with pytest.raises(SnapshotError, match="unknown type"):
        Snapshot.from_files({"x.yaml": {"resources": [{"@type": "type.googleapis.com/google.protobuf.Empty"}]}})


def _request(type_url, nonce="", version="", names=(), error=None, node=NODE, pod="envoy-0"):
    request = DiscoveryRequest(type_url=type_url, response_nonce=nonce, version_info=version,
                               resource_names=list(names))
    request.node.id = node
    request.node.metadata.fields["pod"].string_value = pod
    if error:
        request.error_detail.CopyFrom(Status(code=3, message=error))
    return request


def test_the_stream_sends_clusters_before_the_routes_that_use_them():
    snapshot = Snapshot.from_files(_files())
    stream = AdsStream()
    (cds,) = stream.on_request(_request(CLUSTER), snapshot)
    assert stream.envoy == "envoy-0" and cds.version_info == snapshot.versions[CLUSTER] and len(cds.resources) == 6
    # Envoy asks for listeners and endpoints before it ACKed the clusters: endpoints go, listeners wait.
    assert stream.on_request(_request(LISTENER), snapshot) == []
    (eds,) = stream.on_request(_request(ENDPOINT, names=["epp-bypod"]), snapshot)
    assert stream.on_request(_request(CLUSTER, "999", cds.version_info), snapshot) == []  # a stale nonce: ignored
    assert stream.on_request(_request(CLUSTER, cds.nonce, cds.version_info), snapshot) == []  # ACK; EDS not yet
    assert stream.status(snapshot) is None
    (lds,) = stream.on_request(_request(ENDPOINT, eds.nonce, eds.version_info, ["epp-bypod"]), snapshot)
    assert lds.type_url == LISTENER
    assert stream.on_request(_request(LISTENER, lds.nonce, lds.version_info), snapshot) == []
    (rds,) = stream.on_request(_request(ROUTE, names=["gateway-8080"]), snapshot)
    assert stream.on_request(_request(ROUTE, rds.nonce, rds.version_info, ["gateway-8080"]), snapshot) == []
    assert stream.status(snapshot) == (snapshot.version, "")

    # A weight change sends the route table alone; a cluster change sends the clusters, and the routes after
    # their ACK.
    weights = Snapshot.from_files(_files(weights=(1, 3)))
    (rds2,) = stream.pending(weights)
    assert rds2.type_url == ROUTE and int(rds2.nonce) > int(rds.nonce)
    stream.on_request(_request(ROUTE, rds2.nonce, rds2.version_info, ["gateway-8080"]), weights)
    fewer = Snapshot.from_files(_files(weights=(1, 3), service=False))
    (cds2,) = stream.pending(fewer)
    assert cds2.type_url == CLUSTER and len(cds2.resources) == 5
    (rds3,) = stream.on_request(_request(CLUSTER, cds2.nonce, cds2.version_info), fewer)
    assert rds3.type_url == ROUTE


def test_a_nack_is_reported_and_not_sent_again():
    snapshot = Snapshot.from_files(_files(service=False))
    stream = AdsStream()
    (cds,) = stream.on_request(_request(CLUSTER), snapshot)
    stream.on_request(_request(LISTENER), snapshot)
    long_error = "Proto constraint validation failed: connect_timeout " + "x" * 5000
    assert stream.on_request(_request(CLUSTER, cds.nonce, "", error=long_error), snapshot) == []
    version, error = stream.status(snapshot)
    assert version == snapshot.version and error.startswith("Cluster: Proto constraint")
    assert len(error) <= MAX_ERROR_CHARS + 20
    assert stream.pending(snapshot) == []  # the rejected version is not sent again; listeners wait for clusters
    fixed = Snapshot.from_files(_files(service=True))
    (cds2,) = stream.pending(fixed)
    assert cds2.type_url == CLUSTER
    (lds,) = stream.on_request(_request(CLUSTER, cds2.nonce, cds2.version_info), fixed)
    assert lds.type_url == LISTENER and stream.status(fixed) is None


def test_a_reconnecting_envoy_with_the_current_version_is_sent_nothing():
    snapshot = Snapshot.from_files(_files(service=False))
    stream = AdsStream()
    assert stream.on_request(_request(CLUSTER, version=snapshot.versions[CLUSTER]), snapshot) == []
    assert stream.on_request(_request(LISTENER, version=snapshot.versions[LISTENER]), snapshot) == []
    assert stream.on_request(_request(ENDPOINT, version=snapshot.versions[ENDPOINT], names=["epp-bypod"]),
                             snapshot) == []
    assert stream.on_request(_request(ROUTE, version=snapshot.versions[ROUTE], names=["gateway-8080"]),
                             snapshot) == []
    assert stream.status(snapshot) == (snapshot.version, "")
    # With an older version it gets the current one; with no snapshot (a replica still listing) nothing.
    other = AdsStream()
    assert [r.type_url for r in other.on_request(_request(CLUSTER, version="0ld"), snapshot)] == [CLUSTER]
    assert AdsStream().on_request(_request(CLUSTER), None) == []


def test_the_configmap_is_the_snapshot_every_replica_serves(samples):
    """The leader's ConfigMap (clusters lingering included) builds the same version the leader computes."""
    gateway = samples["Gateway"]
    routing = g.routes_for_gateway(gateway, [samples["HTTPRoute"]], [samples["InferencePool"]], [], [])
    config = g.render_config(gateway, routing, xds=ADDRESS)
    cm, dep, _ = g.desired_envoy_objects(gateway, config, "envoy", now=1000.0)
    assert snapshot_of(cm).version == config_version(config)
    # The pool's route goes: its clusters linger in the ConfigMap, and so in the snapshot.
    without = g.render_config(gateway, g.routes_for_gateway(gateway, [], [], [], []), xds=ADDRESS)
    cm2, dep2, _ = g.desired_envoy_objects(gateway, without, "envoy", previous_config_map=cm, now=1001.0)
    assert set(snapshot_of(cm2).resources[CLUSTER]) == set(snapshot_of(cm).resources[CLUSTER])
    assert not snapshot_of(cm2).resources[ROUTE]["gateway-8080"].value == \
        snapshot_of(cm).resources[ROUTE]["gateway-8080"].value
    # The pods mount the bootstrap alone and do not roll; they name themselves to the xDS server.
    assert dep2 == dep
    pod = dep["spec"]["template"]["spec"]
    assert pod["volumes"][0]["configMap"]["items"] == [{"key": BOOTSTRAP_FILE, "path": BOOTSTRAP_FILE}]
    (container,) = pod["containers"]
    assert container["command"][-2:] == ["--config-yaml", '{"node": {"metadata": {"pod": "$(POD_NAME)"}}}']
    assert container["env"][0]["name"] == "POD_NAME" and "livenessProbe" not in container
    assert json.loads(cm["data"][BOOTSTRAP_FILE])["node"]["id"] == "default/inference-gateway"


def test_the_source_keeps_the_last_good_snapshot_and_wakes_on_reports(samples):
    gateway = samples["Gateway"]
    routing = g.routes_for_gateway(gateway, [samples["HTTPRoute"]], [samples["InferencePool"]], [], [])
    cm = g.desired_envoy_objects(gateway, g.render_config(gateway, routing, xds=ADDRESS), "envoy")[0]
    cache, woken = SnapshotCache(), []
    changed = []
    cache.watch(changed.append)
    source = ConfigMapSource(None, cache, on_reports=lambda ns, name: woken.append((ns, name)))
    source.apply("ADDED", cm)
    node = "default/inference-gateway"
    good = cache.get(node)
    assert good is not None and changed == [node] and woken == []
    broken = copy.deepcopy(cm)
    broken["data"][CDS_FILE] = '{"resources": [{"@type": "nonsense"}]}'
    source.apply("MODIFIED", broken)
    assert cache.get(node) is good and changed == [node]
    reported = copy.deepcopy(cm)
    reported["metadata"]["annotations"] = {"xds.kvgate.dev/envoy-0": acks.report_value(good.version, "")}
    source.apply("MODIFIED", reported)
    assert woken == [("default", "inference-gateway-envoy")]
    source.apply("DELETED", cm)
    assert cache.get(node) is None


def test_reports_and_programmed():
    assert acks.annotation_key("envoy-7f9-abc") == "xds.kvgate.dev/envoy-7f9-abc"
    assert acks.annotation_key("Bad/Name") is None and acks.annotation_key("x" * 64) is None
    cm = {"metadata": {"annotations": {
        "xds.kvgate.dev/a": acks.report_value("abc1", ""), "xds.kvgate.dev/b": acks.report_value("abc1", "bad"),
        "xds.kvgate.dev/c": "not json", "xds.kvgate.dev/d": json.dumps({"version": "NOT-HEX"}), "other": "x"}}}
    assert acks.reports_of(cm) == {"a": ("abc1", ""), "b": ("abc1", "bad")}
    assert acks.stale_keys(cm, {"a"}) == ["xds.kvgate.dev/b", "xds.kvgate.dev/c", "xds.kvgate.dev/d"]
    assert acks.xds_programmed({"a": ("abc1", "")}, ["a"], "abc1") == (True, "Programmed",
                                                                       "1 Envoy(s) serve config abc1")
    assert acks.xds_programmed({"a": ("abc0", "")}, ["a"], "abc1")[:2] == (False, "Pending")
    assert acks.xds_programmed({}, [], "abc1")[:2] == (False, "Pending")
    ok, reason, message = acks.xds_programmed({"a": ("abc1", ""), "b": ("abc1", "bad")}, ["a"], "abc1")
    assert (ok, reason) == (False, "Invalid") and message == "Envoy b rejected config abc1: bad"


def _programmed(kube):
    gw = kube.stored("Gateway", "inference-gateway")
    return next((c["status"], c["reason"], c["message"]) for c in gw["status"]["conditions"]
                if c["type"] == "Programmed")


def test_the_leader_waits_for_the_envoys_ack(samples):
    kube = MemoryKube()
    for kind in ("InferencePool", "GatewayClass", "Gateway", "HTTPRoute"):
        kube.put(samples[kind])
    config = OperatorConfig(engine_image="img", epp_image="img", envoy_image="envoy", envoy_config_source="xds",
                            xds_address=ADDRESS)
    reconciler = GatewayReconciler(kube, config, PermanentFailureLog())
    reconciler.reconcile()
    cm = kube.stored("ConfigMap", "inference-gateway-envoy")
    version = snapshot_of(cm).version
    # The Envoy Deployment turns ready with one pod, which has not answered yet.
    dep = kube.stored("Deployment", "inference-gateway-envoy")
    dep["status"] = {"readyReplicas": 1}
    svc = kube.stored("Service", "inference-gateway-envoy")
    svc["spec"]["clusterIP"] = "10.96.0.10"
    labels = dep["spec"]["template"]["metadata"]["labels"]
    kube.put({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "gw-envoy-1", "namespace": "default",
                                                              "labels": labels},
              "status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    acks.patch_annotations(kube, "default", "inference-gateway-envoy",
                           {"xds.kvgate.dev/gone-pod": acks.report_value(version, "old news")})
    reconciler.reconcile()
    assert _programmed(kube) == ("False", "Pending", f"0 of 1 ready Envoy(s) serve config {version}")
    assert "xds.kvgate.dev/gone-pod" not in kube.stored("ConfigMap", "inference-gateway-envoy")["metadata"].get(
        "annotations", {})
    acks.patch_annotations(kube, "default", "inference-gateway-envoy",
                           {"xds.kvgate.dev/gw-envoy-1": acks.report_value(version, "")})
    reconciler.reconcile()
    assert _programmed(kube) == ("True", "Programmed", f"1 Envoy(s) serve config {version}")
    acks.patch_annotations(kube, "default", "inference-gateway-envoy",
                           {"xds.kvgate.dev/gw-envoy-1": acks.report_value(version, "Cluster: invalid thing")})
    reconciler.reconcile()
    assert _programmed(kube) == ("False", "Invalid",
                                 f"Envoy gw-envoy-1 rejected config {version}: Cluster: invalid thing")


def test_xds_flags_are_checked_at_start(capsys):
    from kvgate.cli import build_parser
    from kvgate.operator.main import run_operator

    parser = build_parser()
    for bad in (["--xds-address", "no-port"], ["--xds-address", "h:99999"], ["--xds-port", "0"],
                ["--xds-max-streams", "0"], ["--envoy-config-source", "grpc"]):
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args(["operator", *bad])
        assert exit_.value.code == 2, bad
    args = parser.parse_args(["operator", "--envoy-config-source", "xds"])
    assert run_operator(args) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "kvgate operator: --envoy-config-source xds needs --xds-address HOST:PORT")
    args = parser.parse_args(["operator", "--xds-address", "kvgate-xds.ns.svc.cluster.local:18000"])
    assert (args.xds_address, args.envoy_config_source) == (XdsAddress("kvgate-xds.ns.svc.cluster.local", 18000),
                                                            "files")
