"""The Grafana dashboard the chart ships (charts/kvgate/dashboards, a ConfigMap for Grafana's sidecar) and the
PodMonitors that feed it.

Every panel's and variable's PromQL is parsed with a real PromQL parser (`promql-parser`, Prometheus's grammar)
and every metric name and label it uses is checked against what really carries it: the /metrics pages of a real
EPP and real engines (started here, `processes`), plus the target labels the chart's PodMonitors attach
(`namespace`, `pod`, their relabelings' `pool` / `modelserver`). The PodMonitors' selectors and ports are checked
against the pods the operator's own code makes for the chart's sample pool.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from collections import Counter, defaultdict

import httpx
import pytest

from tests.test_helm_chart import CHART, NAMESPACE, helm, render

promql_parser = pytest.importorskip("promql_parser",
                                    reason="promql-parser is not installed (pip install promql-parser)")

ENABLED = {"dashboards": {"enabled": True}, "monitoring": {"podMonitors": {"enabled": True, "assumeCRDs": True}},
           "samplePool": {"enabled": True}}
# Grafana replaces its interval variables before Prometheus sees a query; any duration parses the same.
GRAFANA_INTERVALS = re.compile(r"\$__(rate_interval|interval|range)\b|\$\{__(rate_interval|interval|range)\}")
VARIABLE_USE = re.compile(r"\$\{?(\w+)")
LABEL_VALUES = re.compile(r"^label_values\((.*),\s*(\w+)\)$", re.S)
# What the Prometheus Operator puts on every PodMonitor target (besides the relabelings' labels).
POD_MONITOR_TARGET_LABELS = {"namespace", "pod", "container", "endpoint", "job", "instance"}
# kube-state-metrics' Deployment series (its documented names and labels): kvgate does not export replica counts.
# The operator's per-ModelServer series carry the ModelServer's own namespace (the operator's PodMonitor honours
# it); its other series have only the target's: the namespace the operator runs in.
OPERATOR_POOL_SERIES = "kvgate_operator_autoscale_"
KUBE_STATE_METRICS = {"kube_deployment_spec_replicas": {"namespace", "deployment"},
                      "kube_deployment_status_replicas_available": {"namespace", "deployment"}}


# --- the rendered chart ----------------------------------------------------------------------------------------


@functools.cache
def _objects() -> list[dict]:
    return render(ENABLED)


def dashboards() -> dict[str, dict]:
    """File name -> dashboard, as the rendered ConfigMap carries them."""
    (config_map,) = [o for o in _objects() if o["kind"] == "ConfigMap"]
    return {name: json.loads(text) for name, text in config_map["data"].items()}


def pod_monitors() -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in _objects() if o["kind"] == "PodMonitor"}


def panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out += panel.get("panels", [])  # a collapsed row's panels
    return out


def queries(dashboard: dict) -> list[tuple[str, str, str | None]]:
    """(where, PromQL, label asked of it) for every panel target, annotation and query variable; a variable's
    label_values(selector, label) gives its selector and its label."""
    out = []
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            out.append((f"panel {panel['title']!r} {target['refId']}", target["expr"], None))
    for annotation in dashboard["annotations"]["list"]:
        out.append((f"annotation {annotation['name']!r}", annotation["expr"], None))
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = LABEL_VALUES.match(query.strip())
            assert m, f"variable {var['name']}: only label_values(selector, label) is used here: {query}"
            out.append((f"variable {var['name']}", m.group(1), m.group(2)))
    return out


def parse(expr: str):
    return promql_parser.parse(GRAFANA_INTERVALS.sub("5m", expr))


# --- what a query uses ------------------------------------------------------------------------------------------


def _selectors(node) -> list:
    found = []

    def visit(n):
        if isinstance(n, promql_parser.VectorSelector):
            found.append(n)

    promql_parser.walk(node, visit)
    return found


def _name(selector) -> str:
    if selector.name:
        return selector.name
    (name,) = [m.value for m in selector.matchers.matchers if m.name == "__name__"]
    return name


def uses(expr: str, asked_label: str | None = None) -> dict[str, set[str]]:
    """Metric name -> the labels the query needs it to carry: those of its own matchers, and those of every
    `by` / `on` / `group_left` above it (each metric under an aggregation must carry its grouping labels)."""
    needed: dict[str, set[str]] = defaultdict(set)

    def visit(n):
        if isinstance(n, promql_parser.VectorSelector):
            needed[_name(n)] |= {m.name for m in n.matchers.matchers if m.name != "__name__"}
            return
        if isinstance(n, promql_parser.AggregateExpr) and n.modifier is not None:
            assert n.modifier.type == promql_parser.AggModifierType.By, f"{expr}: use `by`, not `without`"
            for selector in _selectors(n):
                needed[_name(selector)] |= set(n.modifier.labels)
        if isinstance(n, promql_parser.BinaryExpr) and n.modifier is not None:
            matching = n.modifier.matching
            if matching is not None:
                assert matching.type == promql_parser.LabelModifierType.Include, f"{expr}: use `on`, not `ignoring`"
                for selector in _selectors(n):  # both sides match on these
                    needed[_name(selector)] |= set(matching.labels)
            # group_left copies its labels from the right ("one") side, group_right from the left
            card = n.modifier.card
            one_side = (n.rhs if card == promql_parser.VectorMatchCardinality.ManyToOne else
                        n.lhs if card == promql_parser.VectorMatchCardinality.OneToMany else None)
            for selector in _selectors(one_side) if one_side is not None else ():
                needed[_name(selector)] |= set(n.modifier.group_labels)

    root = parse(expr)
    promql_parser.walk(root, visit)
    if asked_label:
        for selector in _selectors(root):
            needed[_name(selector)].add(asked_label)
    return dict(needed)


# --- the dashboard without processes ----------------------------------------------------------------------------


def test_dashboard_configmap_is_the_sidecars_and_carries_every_dashboard_file():
    (config_map,) = [o for o in _objects() if o["kind"] == "ConfigMap"]
    assert config_map["metadata"]["name"] == "kvgate-dashboards"
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["namespace"] == NAMESPACE
    files = sorted(p.name for p in (CHART / "dashboards").glob("*.json"))
    assert files and sorted(config_map["data"]) == files
    for name in files:
        assert json.loads(config_map["data"][name]) == json.loads((CHART / "dashboards" / name).read_text())
    moved = render({"dashboards": {"enabled": True, "namespace": "monitoring", "labels": {"team": "x"},
                                   "annotations": {"grafana_folder": "kvgate"}}})
    (config_map,) = [o for o in moved if o["kind"] == "ConfigMap"]
    assert config_map["metadata"]["namespace"] == "monitoring"
    assert config_map["metadata"]["labels"]["team"] == "x"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "kvgate"}


def test_nothing_of_the_dashboard_or_monitors_renders_by_default():
    kinds = Counter(o["kind"] for o in render())
    assert "PodMonitor" not in kinds and "ConfigMap" not in kinds


def test_pod_monitors_need_the_prometheus_operator_api():
    """Enabled but not asserted: the (offline) render's .Capabilities lacks monitoring.coreos.com/v1."""
    objects = render({"monitoring": {"podMonitors": {"enabled": True}}})
    assert not [o for o in objects if o["kind"] == "PodMonitor"]
    assert sorted(pod_monitors()) == ["kvgate-engines", "kvgate-epp", "kvgate-operator"]


def test_lint_passes_with_the_dashboard_and_monitors():
    report = helm.lint(CHART, ENABLED, namespace=NAMESPACE, kube_version="v1.20.0")
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


@pytest.mark.parametrize("values, namespace_selector", [
    ({}, {"matchNames": [NAMESPACE]}),
    ({"watchNamespaces": ["team-a", "team-b"]}, {"matchNames": ["team-a", "team-b"]}),
    ({"allNamespaces": True}, {"any": True}),
])
def test_pod_monitors_cover_the_namespaces_the_operator_serves(values, namespace_selector):
    objects = render({**values, "monitoring": {"podMonitors": {"enabled": True, "assumeCRDs": True,
                                                               "labels": {"release": "kps"}}}})
    monitors = [o for o in objects if o["kind"] == "PodMonitor" and o["metadata"]["name"] != "kvgate-operator"]
    assert len(monitors) == 2
    (operator,) = [o for o in objects if o["metadata"]["name"] == "kvgate-operator"]  # where the operator runs
    assert operator["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    # the autoscaler's series keep the ModelServer's namespace, not the operator pod's
    assert operator["spec"]["podMetricsEndpoints"][0]["honorLabels"] is True
    for monitor in monitors:
        assert monitor["spec"]["namespaceSelector"] == namespace_selector
        assert monitor["metadata"]["labels"]["release"] == "kps"


def _operator_pods() -> dict[str, tuple[dict, str, str]]:
    """Monitor name -> (the pod template the operator makes for the chart's sample pool, {relabeled label: the
    name it must carry})."""
    from kvgate.operator.modelserver import desired_engine_deployment
    from kvgate.operator.pool import desired_epp_objects

    pool = copy.deepcopy(next(o for o in _objects() if o["kind"] == "InferencePool"))
    modelserver = copy.deepcopy(next(o for o in _objects() if o["kind"] == "ModelServer"))
    for obj in (pool, modelserver):
        obj["metadata"]["uid"] = f"uid-{obj['metadata']['name']}"
    (epp,) = [o for o in desired_epp_objects(pool, "kvgate:test") if o["kind"] == "Deployment"]
    engines = desired_engine_deployment(modelserver, pool, "kvgate:test")
    return {"kvgate-epp": (epp["spec"]["template"], {"pool": pool["metadata"]["name"]}),
            "kvgate-engines": (engines["spec"]["template"], {"modelserver": modelserver["metadata"]["name"],
                                                             "pool": pool["metadata"]["name"]})}


def test_pod_monitors_select_the_operators_pods_on_their_metrics_ports():
    monitors = pod_monitors()
    for name, (template, owners) in _operator_pods().items():
        spec = monitors[name]["spec"]
        pod_labels = template["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= pod_labels.items(), (name, pod_labels)
        (endpoint,) = spec["podMetricsEndpoints"]
        ports = {p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
        assert endpoint["port"] in ports, (name, ports)
        # the relabelings copy the pod labels that name the pool and the ModelServer
        copied = {}
        for relabel in endpoint["relabelings"]:
            source = relabel["sourceLabels"][0].removeprefix("__meta_kubernetes_pod_label_")
            (key,) = [k for k in pod_labels if re.sub(r"[^a-zA-Z0-9_]", "_", k) == source]
            copied[relabel["targetLabel"]] = pod_labels[key]
        assert copied == owners, name
    # neither monitor picks up the other's pods
    pods = _operator_pods()
    for name, other in (("kvgate-epp", "kvgate-engines"), ("kvgate-engines", "kvgate-epp")):
        assert not monitors[name]["spec"]["selector"]["matchLabels"].items() \
            <= pods[other][0]["metadata"]["labels"].items()


def test_every_query_parses_with_the_prometheus_grammar():
    for dashboard in dashboards().values():
        found = queries(dashboard)
        assert len(found) >= 20
        for where, expr, _ in found:
            try:
                parse(expr)
            except Exception as exc:  # the parser's own error type: report where
                pytest.fail(f"{where}: {exc}: {expr}")


def test_dashboard_grafana_basics():
    """Unique dashboard uids and panel ids, a Prometheus data source variable every panel and query uses, every
    variable a query names defined, no hard-coded namespace, panels laid out without overlapping."""
    found = dashboards()
    uids = [d["uid"] for d in found.values()]
    assert all(uids) and len(set(uids)) == len(uids)
    for name, dashboard in found.items():
        assert dashboard["title"] and dashboard["schemaVersion"] >= 36, name
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        all_panels = panels(dashboard)
        ids = [p["id"] for p in all_panels]
        assert len(set(ids)) == len(ids), name
        for panel in all_panels:
            if panel["type"] == "row":
                continue
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            assert panel["targets"] and panel["title"] and panel.get("description"), panel["title"]
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == "${datasource}"
        for var in variables.values():
            if var["type"] == "query":
                assert var["datasource"]["uid"] == "${datasource}"
        for annotation in dashboard["annotations"]["list"]:
            assert annotation["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, annotation["name"]
        for where, expr, _ in queries(dashboard):
            assert {v for v in VARIABLE_USE.findall(expr) if not v.startswith("__")} <= variables.keys(), where
            for selector in _selectors(parse(expr)):
                namespace = [m for m in selector.matchers.matchers if m.name == "namespace"]
                # the operator's series come from where it runs (the release namespace), not the pools', but for
                # the autoscaler's, labelled with the ModelServer's own
                name = _name(selector)
                wanted = ("$operator_namespace" if name.startswith("kvgate_operator_")
                          and not name.startswith(OPERATOR_POOL_SERIES) else "$namespace")
                if where not in ("variable namespace", "variable operator_namespace"):
                    assert [m.value for m in namespace] == [wanted], f"{where}: {expr}"
        cells = set()
        for panel in all_panels:
            g = panel["gridPos"]
            assert g["x"] + g["w"] <= 24, panel["title"]
            mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
            assert not mine & cells, f"panel {panel['title']!r} overlaps another"
            cells |= mine


def test_uses_reads_names_and_labels_from_the_syntax_tree():
    """The helper the scrape test relies on: histogram series, matchers, by / on / group_left, label_values."""
    got = uses('histogram_quantile(0.9, sum by (le, pod) (rate(a_bucket{namespace="$namespace"}[$__rate_interval])))'
               ' / on (pod) group_left (pool) b{x=~"y"}')
    assert got == {"a_bucket": {"le", "pod", "namespace"}, "b": {"x", "pod", "pool"}}
    assert uses('vllm:num_requests_running{namespace="n"}', "modelserver") == {
        "vllm:num_requests_running": {"namespace", "modelserver"}}


# --- against the real processes -------------------------------------------------------------------------------

FLOW_CONFIG = """apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: queue-scorer
- type: round-robin-fairness-policy
saturationDetector: {queueDepthThreshold: 1, kvCacheUtilThreshold: 0.95}
flowControl:
  defaultRequestTTL: 30s
  maxRequests: 100
  defaultPriorityBand: {fairnessPolicyRef: round-robin-fairness-policy}
"""


def _exported(text: str) -> dict[str, set[str]]:
    """Sample name -> the label names its samples carry (histograms: _bucket / _sum / _count each)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, set[str]] = defaultdict(set)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] |= set(sample.labels)
    return out


SIM = ["--backend", "sim", "--max-num-seqs", "1", "--sim-step-overhead-ms", "10"]
REQUESTS = 12


def _union(into: dict[str, set[str]], text: str) -> None:
    for name, labels in _exported(text).items():
        into.setdefault(name, set()).update(labels)


@pytest.fixture(scope="module")
def scraped(tmp_path_factory) -> dict[str, dict[str, set[str]]]:
    """Process ("epp" / "engine") -> its exported series, scraped during and after real traffic through Envoy:
    engines taking one request at a time and a saturation threshold of one waiting request, so that flow control
    holds requests while the EPP is scraped; peer sync on so its families have samples."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.gateway import Gateway
    from tests.procs import free_port

    tmp = tmp_path_factory.mktemp("dashboard")
    (tmp / "logs").mkdir()
    epp_args = ["--config-text", FLOW_CONFIG, "--peer-sync-bind", f"tcp://127.0.0.1:{free_port()}",
                "--peer-sync-insecure"]
    epp: dict[str, set[str]] = {}
    engines: dict[str, set[str]] = {}
    with Gateway(tmp / "logs", tmp / "cache", [SIM] * 2, epp_args=epp_args) as gw:
        def complete(i: int) -> httpx.Response:
            body = {"model": "sim-model", "prompt": f"shared prefix {i}", "max_tokens": 24, "ignore_eos": True,
                    "stream": i % 2 == 0}
            return httpx.post(gw.url + "/v1/completions", json=body, timeout=60)

        with ThreadPoolExecutor(REQUESTS) as pool:
            answers = [pool.submit(complete, i) for i in range(REQUESTS)]
            while not all(a.done() for a in answers):
                _union(epp, gw.epp.metrics())
        assert [a.result().status_code for a in answers] == [200] * REQUESTS
        _union(epp, gw.epp.metrics())
        for engine in gw.engines:
            _union(engines, httpx.get(engine.url + "/metrics", timeout=5).text)
    return {"epp": epp, "engine": engines, "operator": _operator_series()}


def _operator_series() -> dict[str, set[str]]:
    """The operator's metrics as its --metrics-port serves them (its real server, in process: the operator itself
    needs an API server), once leading, after its real autoscaler looked at the chart's sample ModelServer twice
    (its pool's EPP page served by the EPP's real exporter, a second EPP pod not answering): scaled from zero, then
    under load, so that every autoscaling family has samples."""
    from kvgate.operator import naming
    from kvgate.operator.autoscaler import Autoscaler
    from kvgate.operator.metrics import OperatorMetrics
    from tests.operator.epp_exporter import FakeEpp
    from tests.operator.memory_kube import MemoryKube
    from tests.procs import free_port

    kube = MemoryKube()
    pool = kube.put(copy.deepcopy(next(o for o in _objects() if o["kind"] == "InferencePool")))
    modelserver = copy.deepcopy(next(o for o in _objects() if o["kind"] == "ModelServer"))
    modelserver["spec"].update(replicas=0, minReplicas=0, maxReplicas=4)
    modelserver = kube.put(modelserver)
    labels = naming.selector_labels("epp", naming.name_of(pool))
    for name, ip in (("epp-answers", "127.0.0.1"), ("epp-refuses", "127.0.0.2")):  # nothing listens on .2
        kube.put({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE,
                                                                  "labels": labels},
                  "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}})
    metrics, port, epp = OperatorMetrics(), free_port(), FakeEpp()
    metrics.serve("127.0.0.1", port)
    try:
        metrics.set_leader(True, transition=True)
        scaler = Autoscaler(kube, None, lambda key: None, metrics_port=epp.port, metrics=metrics.autoscale)
        epp.set([], held=1)
        scaler.run_once()  # from zero
        kube.put({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {
            "name": naming.engine_deployment_name(modelserver), "namespace": NAMESPACE},
            "status": {"readyReplicas": 1}})
        epp.set([(6, 1, 0.5)], held=2)
        epp.metrics.observe_flow("default", 0, "Dispatched", 2.0)
        scaler.run_once()  # a load step
        return _exported(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text)
    finally:
        metrics.close()
        epp.close()


def _target_labels(monitor: dict) -> set[str]:
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    return POD_MONITOR_TARGET_LABELS | {r["targetLabel"] for r in endpoint.get("relabelings", [])}


@pytest.mark.processes
def test_every_metric_and_label_a_query_uses_is_exported(scraped):
    monitors = pod_monitors()
    carried = {"epp": _target_labels(monitors["kvgate-epp"]), "engine": _target_labels(monitors["kvgate-engines"]),
               "operator": _target_labels(monitors["kvgate-operator"])}
    problems, used = [], set()
    for dashboard in dashboards().values():
        for where, expr, asked in queries(dashboard):
            for name, labels in uses(expr, asked).items():
                used.add(name)
                if name in KUBE_STATE_METRICS:
                    missing = labels - KUBE_STATE_METRICS[name]
                    if missing:
                        problems.append(f"{where}: kube-state-metrics' {name} has no label {sorted(missing)}")
                    continue
                owners = [p for p, series in scraped.items() if name in series]
                if not owners:
                    problems.append(f"{where}: no process exports {name}")
                    continue
                (process,) = owners
                own = labels & {"namespace"} if name.startswith(OPERATOR_POOL_SERIES) else set()
                if own - scraped[process][name]:  # the target's namespace would be the operator's own
                    problems.append(f"{where}: {name} ({process}) does not carry its ModelServer's namespace")
                missing = labels - scraped[process][name] - carried[process]
                if missing:
                    problems.append(f"{where}: {name} ({process}) carries no label {sorted(missing)}")
    assert not problems, "\n".join(problems)
    # the dashboard reads both processes, and the families this test turned on
    assert {n for n in used if n.startswith("kvgate_epp_")} and {n for n in used if n.startswith("vllm:")}
    assert "inference_extension_flow_control_request_queue_duration_seconds_bucket" in used
    assert "kvgate_epp_peer_sync_total" in used
    assert "kvgate_operator_leader" in used
    assert {"kvgate_operator_autoscale_desired_replicas", "kvgate_operator_autoscale_scaled_total",
            "kvgate_operator_autoscale_usage_ratio", "kvgate_operator_autoscale_epp_read_failures_total"} <= used

