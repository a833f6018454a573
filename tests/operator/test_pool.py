import copy

import pytest

from kvgate.epp.scheduling.config import parse_config
from kvgate.operator import naming
from kvgate.operator import pool as p
from tests.epp.helpers import LIST_CONFIG
from tests.operator.conftest import NOW, round_trips

IMAGE = "kvgate:test"


def _by_kind(objs):
    return {o["kind"]: o for o in objs}


def test_sample_pool_epp_objects(samples):
    pool = samples["InferencePool"]
    objs = p.desired_epp_objects(pool, IMAGE, None)
    assert [o["kind"] for o in objs] == ["ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Deployment", "Service"]
    for obj in objs:
        assert round_trips(obj), obj["kind"]
        assert obj["metadata"]["ownerReferences"][0]["uid"] == "uid-demo-pool"
        assert naming.is_managed(obj) and obj["metadata"]["namespace"] == "default"
    k = _by_kind(objs)
    (c,) = k["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["kvgate", "--log-level", "info", "epp", "--pool-name", "demo-pool", "--pool-namespace", "default",
                            "--grpc-host", "0.0.0.0", "--grpc-port", "9002", "--grpc-health-port", "9003",
                            "--metrics-port", "9090", "--config-file", "/config/epp.yaml", "--shutdown-timeout", "60",
                            "--drain-health", "serving"]
    # preStop 5 s (still SERVING while the Gateways learn of the new pod), drain 60 s, a margin to exit
    assert c["lifecycle"] == {"preStop": {"exec": {"command": ["sleep", "5"]}}}
    assert k["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 75
    assert "tcpSocket" in c["readinessProbe"] and "grpc" not in c["readinessProbe"]
    assert k["Deployment"]["spec"]["template"]["spec"]["serviceAccountName"] == "demo-pool-epp"
    svc = k["Service"]
    assert svc["metadata"]["name"] == "demo-pool-epp"
    ports = {port["name"]: port for port in svc["spec"]["ports"]}
    assert ports["grpc"]["port"] == 9002 and ports["grpc"]["appProtocol"] == "kubernetes.io/h2c"
    assert (ports["grpc-health"]["port"], ports["metrics"]["port"]) == (9003, 9090)
    pod_labels = k["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert all(pod_labels[key] == v for key, v in svc["spec"]["selector"].items())
    parse_config(k["ConfigMap"]["data"]["epp.yaml"])  # the EPP accepts the default config


def test_rbac_is_exactly_read_only_on_the_listed_resources(samples):
    role = _by_kind(p.desired_epp_objects(samples["InferencePool"], IMAGE))["Role"]
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}
    expected = {(g, r, v) for g, r in [("", "pods"), ("inference.networking.k8s.io", "inferencepools"),
                                       ("inference.networking.x-k8s.io", "inferenceobjectives"),
                                       ("inference.networking.x-k8s.io", "inferencemodelrewrites")]
                for v in ("get", "list", "watch")}
    assert granted == expected
    binding = _by_kind(p.desired_epp_objects(samples["InferencePool"], IMAGE))["RoleBinding"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "demo-pool-epp", "namespace": "default"}]


def test_config_change_rolls_pods_and_output_is_deterministic(samples):
    pool = samples["InferencePool"]
    assert p.desired_epp_objects(pool, IMAGE) == p.desired_epp_objects(copy.deepcopy(pool), IMAGE)
    other = p.DEFAULT_EPP_CONFIG.replace("weight: 3", "weight: 5")
    a = _by_kind(p.desired_epp_objects(pool, IMAGE))["Deployment"]["spec"]["template"]["metadata"]
    b = _by_kind(p.desired_epp_objects(pool, IMAGE, other))["Deployment"]["spec"]["template"]["metadata"]
    assert a["annotations"]["kvgate.dev/config-digest"] != b["annotations"]["kvgate.dev/config-digest"]


@pytest.mark.parametrize("mutate,reason", [
    (lambda pool: pool["spec"]["endpointPickerRef"].update(kind="Deployment"), "InvalidExtensionRef"),
    (lambda pool: pool["spec"]["endpointPickerRef"].update(port={"number": 9090}), "InvalidExtensionRef"),
])
def test_unusable_pools_give_problems_not_objects(samples, mutate, reason):
    pool = copy.deepcopy(samples["InferencePool"])
    mutate(pool)
    assert p.epp_problems(pool, None)[0]["reason"] == reason
    assert p.desired_epp_objects(pool, IMAGE) == []


def test_bad_config_is_a_problem(samples):
    assert p.epp_problems(samples["InferencePool"], "kind: Nope\n")[0]["reason"] == "InvalidConfig"
    assert p.desired_epp_objects(samples["InferencePool"], IMAGE, "plugins: [") == []


def test_ownership_rule(samples):
    pool, ms = samples["InferencePool"], samples["ModelServer"]
    ours = _by_kind(p.desired_epp_objects(pool, IMAGE))["Service"]
    users = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "demo-pool-epp", "namespace": "default"}}
    assert p.manages_epp(pool, None, [ms])            # absent: the operator creates it
    assert p.manages_epp(pool, ours, [ms])            # ours: the operator keeps it up to date
    assert not p.manages_epp(pool, users, [ms])       # the user's: left alone
    labelled_only = copy.deepcopy(ours)
    labelled_only["metadata"]["ownerReferences"] = []
    assert not p.manages_epp(pool, labelled_only, [ms])
    assert not p.manages_epp(pool, None, [])          # no ModelServer joins it: not kvgate's pool
    annotated = copy.deepcopy(pool)
    annotated["metadata"]["annotations"] = {p.EPP_ANNOTATION: "managed"}
    assert p.manages_epp(annotated, None, [])
    annotated["metadata"]["annotations"] = {p.EPP_ANNOTATION: "external"}
    assert not p.manages_epp(annotated, None, [ms])


def _gateway(name="g", ns="infra"):
    return {"kind": "Gateway", "metadata": {"name": name, "namespace": ns}}


def test_pool_status_per_gateway(samples):
    pool = samples["InferencePool"]
    svc = _by_kind(p.desired_epp_objects(pool, IMAGE))["Service"]
    status = p.pool_status(pool, [_gateway("b"), _gateway("a")], svc, now=NOW)
    assert [e["parentRef"]["name"] for e in status["parents"]] == ["a", "b"]
    entry = status["parents"][0]
    assert entry["parentRef"] == {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "a",
                                  "namespace": "infra"}
    assert entry["controllerName"] == "kvgate.dev/gateway-controller"
    conds = {c["type"]: (c["status"], c["reason"]) for c in entry["conditions"]}
    assert conds == {"Accepted": ("True", "Accepted"), "ResolvedRefs": ("True", "ResolvedRefs")}


def test_pool_status_missing_epp_service_and_foreign_parents_kept(samples):
    pool = copy.deepcopy(samples["InferencePool"])
    foreign = {"parentRef": {"name": "x"}, "controllerName": "other.dev/c", "conditions": []}
    pool["status"] = {"parents": [foreign]}
    status = p.pool_status(pool, [_gateway()], None, now=NOW)
    assert status["parents"][0] == foreign
    resolved = next(c for c in status["parents"][1]["conditions"] if c["type"] == "ResolvedRefs")
    assert (resolved["status"], resolved["reason"]) == ("False", "InvalidExtensionRef")
    assert p.pool_status(pool, [], None, now=NOW) == {"parents": [foreign]}


def test_pool_status_is_stable_across_resyncs(samples):
    pool = copy.deepcopy(samples["InferencePool"])
    first = p.pool_status(pool, [_gateway()], None, now=NOW)
    pool["status"] = first
    assert p.pool_status(pool, [_gateway()], None, now="2030-01-01T00:00:00Z") == first


def test_epp_resolution_checks_port_and_type(samples):
    pool = samples["InferencePool"]
    svc = {"spec": {"ports": [{"port": 9002}]}}
    assert p.epp_resolution(pool, svc)[0]
    assert not p.epp_resolution(pool, {"spec": {"ports": [{"port": 1}]}})[0]
    assert not p.epp_resolution(pool, {"spec": {"type": "ExternalName", "ports": [{"port": 9002}]}})[0]
    no_ref = copy.deepcopy(pool)
    del no_ref["spec"]["endpointPickerRef"]
    assert p.epp_resolution(no_ref, svc) == (False, "endpointPickerRef is not set")


# --- per-pool EndpointPickerConfig (annotation kvgate.dev/epp-config) ------------------------------------------

TUNED = p.DEFAULT_EPP_CONFIG.replace("weight: 3", "weight: 7")


def _annotated(pool, value):
    pool = copy.deepcopy(pool)
    pool["metadata"].setdefault("annotations", {})[p.CONFIG_ANNOTATION] = value
    return pool


def _user_cm(name="tuned", data=None):
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": "default"},
            "data": {"epp.yaml": TUNED} if data is None else data}


@pytest.mark.parametrize("value,expected", [
    ("tuned", ("tuned", "epp.yaml")), ("tuned/scorers.yaml", ("tuned", "scorers.yaml")),
    (" tuned.v2/k ", ("tuned.v2", "k")),
])
def test_config_ref_parses_configmap_and_key(samples, value, expected):
    assert p.config_ref(samples["InferencePool"]) is None
    assert p.config_ref(_annotated(samples["InferencePool"], value)) == expected


@pytest.mark.parametrize("value", ["", "Tuned", "tuned/bad key", "a/b/c", "/epp.yaml", "x" * 254])
def test_malformed_config_ref_is_invalid_config_ref(samples, value):
    pool = _annotated(samples["InferencePool"], value)
    with pytest.raises(ValueError, match="kvgate.dev/epp-config"):
        p.config_ref(pool)
    assert p.referenced_config_name(pool) is None
    choice = p.choose_epp_config(pool, None, None)
    assert choice.problem["reason"] == "InvalidConfigRef" and choice.config_yaml is None


def test_no_annotation_runs_the_default_config(samples):
    choice = p.choose_epp_config(samples["InferencePool"], None, None)
    assert choice == p.ConfigChoice(p.DEFAULT_EPP_CONFIG, "the default EndpointPickerConfig", None)


def test_a_pool_of_kvgate_engines_publishing_kv_events_runs_kvgates_profile(samples):
    """Every ModelServer of the pool publishes KV events: kvgate's profile (precise prefix from the events, the
    engines' exact backlog), one endpoint per decision as a stock gateway follows; one without events, none, or
    an annotation's config: not."""
    pool, ms = samples["InferencePool"], samples["ModelServer"]
    with_events = copy.deepcopy(ms)
    with_events["spec"]["engine"]["kvEvents"] = {"port": 5557}
    other_pool = copy.deepcopy(with_events)
    other_pool["spec"]["poolRef"]["name"] = "elsewhere"
    choice = p.choose_epp_config(pool, None, None, [with_events, other_pool])
    assert choice.config_yaml == p.KVGATE_EPP_CONFIG and choice.problem is None and "kvgate's profile" in choice.source
    assert not parse_config(choice.config_yaml).returns_lists
    second = copy.deepcopy(with_events)
    second["metadata"]["name"] = "second"
    assert p.choose_epp_config(pool, None, None, [with_events, second]).config_yaml == p.KVGATE_EPP_CONFIG
    assert p.choose_epp_config(pool, None, None, [with_events, ms]).config_yaml == p.DEFAULT_EPP_CONFIG
    assert p.choose_epp_config(pool, None, None, [other_pool]).config_yaml == p.DEFAULT_EPP_CONFIG
    annotated = _annotated(pool, "tuned")
    assert p.choose_epp_config(annotated, _user_cm(), None, [with_events]).config_yaml == TUNED


def test_referenced_config_rolls_out_and_rolls_the_pods(samples):
    pool = _annotated(samples["InferencePool"], "tuned")
    choice = p.choose_epp_config(pool, _user_cm(), None)
    assert choice.problem is None and choice.config_yaml == TUNED
    assert "ConfigMap 'tuned' key 'epp.yaml'" in choice.source
    tuned = _by_kind(p.desired_epp_objects(pool, IMAGE, choice.config_yaml))
    default = _by_kind(p.desired_epp_objects(pool, IMAGE))
    assert tuned["ConfigMap"]["data"] == {"epp.yaml": TUNED}
    digest = "kvgate.dev/config-digest"
    assert (tuned["Deployment"]["spec"]["template"]["metadata"]["annotations"][digest]
            == p.epp_config_digest(TUNED)
            != default["Deployment"]["spec"]["template"]["metadata"]["annotations"][digest])
    # one replica: the new pod starts and becomes ready before the old one is removed
    assert tuned["Deployment"]["spec"]["strategy"] == {"type": "RollingUpdate",
                                                       "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    named_key = p.choose_epp_config(_annotated(pool, "tuned/other.yaml"), _user_cm(data={"other.yaml": TUNED}), None)
    assert named_key.config_yaml == TUNED and named_key.problem is None


def _rolled_out(pool, config_yaml):
    """The EPP's own ConfigMap as the operator wrote it for `config_yaml`."""
    return _by_kind(p.desired_epp_objects(pool, IMAGE, config_yaml))["ConfigMap"]


@pytest.mark.parametrize("referenced,reason,says", [
    (None, "ConfigMapNotFound", "ConfigMap 'tuned'"),
    (_user_cm(data={"other.yaml": "x"}), "ConfigKeyNotFound", "no key 'epp.yaml' (keys: other.yaml)"),
    (_user_cm(data={"epp.yaml": "plugins: ["}), "InvalidConfig", "not valid YAML"),
    (_user_cm(data={"epp.yaml": TUNED.replace("queue-scorer", "no-such-scorer")}), "InvalidConfig", "no-such-scorer"),
])
def test_bad_reference_or_config_keeps_the_last_good_config(samples, referenced, reason, says):
    pool = _annotated(samples["InferencePool"], "tuned")
    first = p.desired_epp_objects(pool, IMAGE, p.choose_epp_config(pool, _user_cm(), None).config_yaml)
    choice = p.choose_epp_config(pool, referenced, _by_kind(first)["ConfigMap"])
    assert choice.problem["reason"] == reason and says in choice.problem["message"], choice.problem
    assert choice.config_yaml == TUNED and choice.source == "its last good config"
    # what the operator applies is exactly what runs: the EPP's pods do not roll, they keep the good config
    assert p.desired_epp_objects(pool, IMAGE, choice.config_yaml) == first
    assert p.running_note(choice, True) == ("The EPP keeps its last good config "
                                            f"(config digest {p.epp_config_digest(TUNED)}).")


def test_bad_config_without_a_last_good_one_makes_no_epp(samples):
    pool = _annotated(samples["InferencePool"], "tuned")
    choice = p.choose_epp_config(pool, None, None)
    assert choice.config_yaml is None and choice.problem["reason"] == "ConfigMapNotFound"
    assert p.running_note(choice, False) == "The EPP is not created or updated until this is fixed."
    # a ConfigMap of that name that is not the operator's (no owner reference to the pool) is no last good config
    foreign = _rolled_out(pool, TUNED)
    foreign["metadata"]["ownerReferences"] = []
    assert p.choose_epp_config(pool, None, foreign).config_yaml is None
    broken = _rolled_out(pool, TUNED)
    broken["data"]["epp.yaml"] = "kind: Nope\n"
    assert p.choose_epp_config(pool, None, broken).config_yaml is None


def _entry(status):
    (entry,) = [e for e in status["parents"] if e["controllerName"] == p.EPP_CONTROLLER_NAME]
    return entry, {c["type"]: c for c in entry["conditions"]}


def test_epp_status_entry_when_all_is_well(samples):
    pool = copy.deepcopy(samples["InferencePool"])
    gateway_entry = {"parentRef": {"name": "g"}, "controllerName": naming.CONTROLLER_NAME, "conditions": []}
    pool["status"] = {"parents": [gateway_entry]}
    choice = p.choose_epp_config(pool, None, None)
    status = p.epp_pool_status(pool, [], p.running_note(choice, True), now=NOW)
    assert status["parents"][1] == gateway_entry  # the Gateways' entries are kept
    entry, conds = _entry(status)
    assert entry["parentRef"] == {"group": "apps", "kind": "Deployment", "name": "demo-pool-epp",
                                  "namespace": "default"}
    assert (conds["Accepted"]["status"], conds["Accepted"]["reason"]) == ("True", "Accepted")
    assert conds["Accepted"]["message"] == (f"The EPP runs the default EndpointPickerConfig (config digest "
                                            f"{p.epp_config_digest(p.DEFAULT_EPP_CONFIG)}).")
    assert (conds["ResolvedRefs"]["status"], conds["ResolvedRefs"]["reason"]) == ("True", "ResolvedRefs")
    assert all(c["lastTransitionTime"] == NOW and c["observedGeneration"] == 1 for c in conds.values())
    # a resync that changes nothing writes the same status
    pool["status"] = status
    assert p.epp_pool_status(pool, [], p.running_note(choice, True), now="2030-01-01T00:00:00Z") == status
    # and the operator's own gateway status keeps the EPP's entry
    assert _entry(p.pool_status(pool, [_gateway()], None, now=NOW))[0] == entry


def test_epp_status_entry_names_the_problem(samples):
    pool = _annotated(samples["InferencePool"], "tuned")
    bad = _user_cm(data={"epp.yaml": TUNED.replace("queue-scorer", "no-such-scorer")})
    choice = p.choose_epp_config(pool, bad, _rolled_out(pool, TUNED))
    _, conds = _entry(p.epp_pool_status(pool, [choice.problem], p.running_note(choice, True), now=NOW))
    assert (conds["Accepted"]["status"], conds["Accepted"]["reason"]) == ("False", "InvalidConfig")
    assert "no-such-scorer" in conds["Accepted"]["message"]
    assert conds["Accepted"]["message"].endswith(f"The EPP keeps its last good config (config digest "
                                                 f"{p.epp_config_digest(TUNED)}).")
    assert conds["ResolvedRefs"]["status"] == "True"  # the reference resolves; its content is the problem
    missing = p.choose_epp_config(pool, None, None)
    _, conds = _entry(p.epp_pool_status(pool, [missing.problem], p.running_note(missing, False), now=NOW))
    for type_ in ("Accepted", "ResolvedRefs"):
        assert (conds[type_]["status"], conds[type_]["reason"]) == ("False", "ConfigMapNotFound")
    assert "ConfigMap 'tuned'" in conds["ResolvedRefs"]["message"]


def test_epp_status_entry_is_dropped_when_the_pool_is_no_longer_managed(samples):
    pool = copy.deepcopy(samples["InferencePool"])
    assert p.without_epp_status(pool) is None  # nothing to write
    foreign = {"parentRef": {"name": "x"}, "controllerName": "other.dev/c", "conditions": []}
    pool["status"] = {"parents": [foreign]}
    pool["status"] = p.epp_pool_status(pool, [], "ok", now=NOW)
    assert p.without_epp_status(pool) == {"parents": [foreign]}


def test_the_two_status_writers_agree_on_the_order(samples):
    """The EPP's entry and the Gateways' entries are written by two reconciles; each keeps the other's entries.
    Were their orders different, each would rewrite the list (a watch event each time) forever."""
    for gateways_first in (True, False):
        pool = copy.deepcopy(samples["InferencePool"])
        writers = [lambda: p.pool_status(pool, [_gateway("b"), _gateway("a")], None, now=NOW),
                   lambda: p.epp_pool_status(pool, [], "ok", now=NOW)]
        if not gateways_first:
            writers.reverse()
        seen = []
        for _ in range(3):
            for write in writers:
                pool["status"] = write()
                seen.append(pool["status"])
        assert seen[-1] == seen[-2] == seen[-3] == seen[-4]
        assert [e["parentRef"]["name"] for e in seen[-1]["parents"]] == ["demo-pool-epp", "a", "b"]


def test_epp_status_entry_is_valid_for_the_pool_crd(samples):
    """Our InferencePool CRD and upstream's both accept the status with the EPP's entry (problems included)."""
    from tests.test_crds import UPSTREAM_POOL_CRD, our_schema, upstream_pool_schema

    pool = _annotated(samples["InferencePool"], "tuned")
    pool["status"] = p.pool_status(pool, [_gateway()], None, now=NOW)
    missing = p.choose_epp_config(pool, None, None)
    pool["status"] = p.epp_pool_status(pool, [missing.problem], p.running_note(missing, False), now=NOW)
    assert [e["controllerName"] for e in pool["status"]["parents"]] == [p.EPP_CONTROLLER_NAME, naming.CONTROLLER_NAME]
    assert our_schema("InferencePool").errors(pool) == []
    if UPSTREAM_POOL_CRD.is_file():
        assert upstream_pool_schema().errors(pool) == []


def test_returns_lists_reads_the_operators_epp_config(samples):
    """Gateways route a pool through override_host (retries over the list) only when the operator's EPP for it
    answers with lists; the default config, no ConfigMap, or one that is not the operator's: one endpoint."""
    pool = samples["InferencePool"]
    default_cm = _by_kind(p.desired_epp_objects(pool, IMAGE))["ConfigMap"]
    lists_cm = _by_kind(p.desired_epp_objects(pool, IMAGE, LIST_CONFIG))["ConfigMap"]
    assert not p.returns_lists(p.running_epp_config(default_cm, pool))
    assert p.returns_lists(p.running_epp_config(lists_cm, pool))
    assert not p.returns_lists(p.running_epp_config(None, pool))
    users = copy.deepcopy(lists_cm)
    users["metadata"]["labels"] = {}
    assert not p.returns_lists(p.running_epp_config(users, pool))


def test_response_needs_reads_the_operators_epp_config(samples):
    """The Gateways send a pool's EPP nothing of the response when the operator's EPP config for it reads nothing
    of it; a config that learns from bodies (predicted-latency-scorer), no ConfigMap, or one that is not the
    operator's: bodies stream through the EPP, as upstream's gateways send them."""
    from tests.test_response_headers_only import LEARNING_CONFIG

    pool = samples["InferencePool"]
    default_cm = _by_kind(p.desired_epp_objects(pool, IMAGE))["ConfigMap"]
    learning_cm = _by_kind(p.desired_epp_objects(pool, IMAGE, LEARNING_CONFIG))["ConfigMap"]
    assert p.response_needs(p.running_epp_config(default_cm, pool)) == "none"
    assert p.response_needs(p.running_epp_config(learning_cm, pool)) == "body"
    assert p.response_needs(p.running_epp_config(None, pool)) == "body"
    users = copy.deepcopy(default_cm)
    users["metadata"]["labels"] = {}
    assert p.response_needs(p.running_epp_config(users, pool)) == "body"


def test_the_draining_epp_reports_not_serving_only_when_gateways_address_its_pods(samples):
    """Behind its Service the draining EPP answers SERVING (the Service is Envoy's one host; the old pod holds
    its health-check connection); addressed by pod IP, NOT_SERVING takes the old pod out at once."""
    pool = samples["InferencePool"]
    for behind_service, health in ((True, "serving"), (False, "not-serving")):
        (dep,) = [o for o in p.desired_epp_objects(pool, IMAGE, behind_service=behind_service)
                  if o["kind"] == "Deployment"]
        command = dep["spec"]["template"]["spec"]["containers"][0]["command"]
        assert command[command.index("--drain-health") + 1] == health


# --- the tokenizer of a precise EPP ---------------------------------------------------------------------------

PRECISE = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: precise-prefix-cache-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: precise-prefix-cache-scorer
  - pluginRef: max-score-picker
"""


def _with_model(ms, name, model):
    ms = copy.deepcopy(ms)
    ms["metadata"]["name"] = name
    ms["spec"]["model"] = model
    return ms


QWEN_PVC = {"path": "/models/qwen", "pvc": {"claimName": "qwen-weights"}}


def _epp_pod(pool, config, tokenizer):
    deployment = _by_kind(p.desired_epp_objects(pool, IMAGE, config, tokenizer=tokenizer))["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return pod, container


def test_a_precise_epp_reads_the_tokenizer_from_the_pools_model_volume(samples):
    pool, ms = samples["InferencePool"], _with_model(samples["ModelServer"], "qwen", QWEN_PVC)
    tokenizer = p.epp_tokenizer(PRECISE, pool, [ms])
    assert tokenizer.problem is None and tokenizer.path == "/models/qwen"
    pod, container = _epp_pod(pool, PRECISE, tokenizer)
    assert container["command"][-2:] == ["--tokenizer", "/models/qwen"]
    # the engine's own volume, read-only, at the path the engines load the model from
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "qwen-weights", "readOnly": True}} in pod["volumes"]
    assert {"name": "model", "mountPath": "/models/qwen", "readOnly": True} in container["volumeMounts"]
    assert round_trips(_by_kind(p.desired_epp_objects(pool, IMAGE, PRECISE, tokenizer=tokenizer))["Deployment"])


@pytest.mark.parametrize("config, models", [
    (None, [QWEN_PVC]),  # the default config tokenizes nothing
    (p.DEFAULT_EPP_CONFIG, [QWEN_PVC]),
    (PRECISE.replace("- type: precise-prefix-cache-scorer",
                     "- type: precise-prefix-cache-scorer\n  parameters: {tokenizer: /opt/tok}"), [QWEN_PVC]),
    (PRECISE, [{"servedModelName": "demo"}]),  # demo / sim: the EPP's built-in byte tokenizer is theirs
    (PRECISE, []),
])
def test_no_model_volume_reaches_an_epp_that_needs_none(samples, config, models):
    pool = samples["InferencePool"]
    servers = [_with_model(samples["ModelServer"], f"ms{i}", m) for i, m in enumerate(models)]
    tokenizer = p.epp_tokenizer(config, pool, servers)
    assert tokenizer == p.EppTokenizer()
    pod, container = _epp_pod(pool, config, tokenizer)
    assert "--tokenizer" not in container["command"]
    assert {v["name"] for v in pod["volumes"]} == {"config", "tmp"}


def test_modelservers_of_other_pools_do_not_count_and_two_models_are_a_problem(samples):
    pool = samples["InferencePool"]
    qwen = _with_model(samples["ModelServer"], "qwen", QWEN_PVC)
    elsewhere = _with_model(samples["ModelServer"], "llama", {"path": "/models/llama", "hostPath": {"path": "/x"}})
    elsewhere["spec"]["poolRef"] = {"name": "other-pool"}
    assert p.epp_tokenizer(PRECISE, pool, [qwen, elsewhere]).path == "/models/qwen"
    same = _with_model(samples["ModelServer"], "qwen-canary", QWEN_PVC)
    assert p.epp_tokenizer(PRECISE, pool, [qwen, same]).path == "/models/qwen"
    elsewhere["spec"]["poolRef"] = {"name": "demo-pool"}
    tokenizer = p.epp_tokenizer(PRECISE, pool, [qwen, elsewhere])
    assert tokenizer.path is None and tokenizer.problem["reason"] == "TokenizerConflict"
    assert "llama, qwen" in tokenizer.problem["message"] and "tokenizer" in tokenizer.problem["message"]


def test_the_reconciler_mounts_the_tokenizer_and_reports_a_conflict(samples):
    from kvgate.operator.config import OperatorConfig
    from kvgate.operator.reconciler import Reconciler
    from tests.operator.memory_kube import MemoryKube

    kube = MemoryKube()
    kube.put(_annotated(samples["InferencePool"], "precise"))
    kube.put(_user_cm("precise", {"epp.yaml": PRECISE}))
    kube.put(_with_model(samples["ModelServer"], "qwen", QWEN_PVC))
    reconciler = Reconciler(kube, OperatorConfig(engine_image=IMAGE, epp_image=IMAGE, envoy_image="envoy:test"))

    def epp():
        pod = kube.stored("Deployment", "demo-pool-epp")["spec"]["template"]["spec"]
        parents = kube.stored("InferencePool", "demo-pool")["status"]["parents"]
        entry = next(e for e in parents if e["controllerName"] == p.EPP_CONTROLLER_NAME)
        return pod, next(c for c in entry["conditions"] if c["type"] == "Accepted")

    reconciler.reconcile_pool("default", "demo-pool")
    pod, accepted = epp()
    assert pod["containers"][0]["command"][-2:] == ["--tokenizer", "/models/qwen"] and accepted["status"] == "True"
    kube.put(_with_model(samples["ModelServer"], "llama", {"path": "/models/llama", "pvc": {"claimName": "llama"}}))
    reconciler.reconcile_pool("default", "demo-pool")
    pod, accepted = epp()  # the EPP still runs (its precise scorer finds no hits) and the status says why
    assert "--tokenizer" not in pod["containers"][0]["command"]
    assert (accepted["status"], accepted["reason"]) == ("False", "TokenizerConflict")
