"""InferencePool → its Endpoint Picker (EPP), and the pool's status.parents as Gateway controllers write it.

Which pools get an operator-made EPP: a pool is kvgate's when a ModelServer joins it or it is annotated
`kvgate.dev/endpoint-picker: managed`, and its endpointPickerRef is a core Service that is either absent
(the operator creates it) or already the operator's (managed-by label and an owner reference to the pool).
A Service that exists without those marks is the user's, and a pool nobody marked as kvgate's is left
alone even when its Service is missing — a pool may name an EPP the user has not deployed yet, and the
operator must not step in front of it (upstream conformance reports such a pool as InvalidExtensionRef).
The annotation `kvgate.dev/endpoint-picker: external` opts a pool with ModelServers out.

A managed pool's EndpointPickerConfig: the default (kvgate's profile when every ModelServer of the pool publishes
KV events, else upstream's), or the one its annotation `kvgate.dev/epp-config:
<configmap>[/<key>]` names (a ConfigMap in the pool's namespace, key `epp.yaml` unless named; the annotation,
not a field, because the InferencePool schema is upstream's). The operator parses it with the EPP's own
parser before rolling it out and copies it into the EPP's ConfigMap; the pod template carries its digest, so a
new config rolls the EPP (one new pod, ready before the old one goes). The EPP reads its config once, so a
roll is how a change arrives whole: no pod ever runs half of one. A missing or invalid config never reaches
the EPP: the operator keeps the config in the EPP's ConfigMap (the last good one) and says why in the pool's
status, in the `status.parents` entry of controller `kvgate.dev/endpoint-picker` (parentRef: the EPP
Deployment), which every managed pool carries whether or not a Gateway routes to it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from kvgate.epp.scheduling.config import (DEFAULT_CONFIG_YAML, KVGATE_PROFILE_YAML, ConfigError, EppConfig,
                                          parse_config)
from kvgate.common.envoy_config import RESPONSE_BODY
from kvgate.epp.leader import lease_name
from kvgate.operator.epp_peer_sync import with_peer_sync
from kvgate.operator import naming
from kvgate.operator.conditions import condition, stamp
from kvgate.operator.modelserver import DEFAULT_MODEL, kv_events_ports, model_volume
from kvgate.operator.spec_shape import pool_problems, pool_ref_name

if TYPE_CHECKING:
    from kvgate.operator.config import TraceExport

EPP_ANNOTATION = "kvgate.dev/endpoint-picker"
REPLICAS_ANNOTATION = "kvgate.dev/epp-replicas"  # 1 (default) to MAX_EPP_REPLICAS; > 1 needs the operator's HA
MAX_EPP_REPLICAS = 5
CONFIG_ANNOTATION = "kvgate.dev/epp-config"  # <configmap>[/<key>] in the pool's namespace
CONFIG_KEY = "epp.yaml"  # the key of the EPP's own ConfigMap, and of a referenced one unless named
CONFIG_FILE = f"/config/{CONFIG_KEY}"
EPP_CONTROLLER_NAME = "kvgate.dev/endpoint-picker"  # writes the EPP's entry in the pool's status.parents
# Problems with a reference (the EPP Service, the config's ConfigMap): the entry's ResolvedRefs says them too.
REF_REASONS = {"InvalidExtensionRef", "InvalidConfigRef", "ConfigMapNotFound", "ConfigKeyNotFound"}

# The EPP's own default (upstream's: queue 2, kv-cache 2, prefix 3, max-score), written into the ConfigMap so that
# it always holds the config the EPP runs; kvgate's profile instead for a pool whose every ModelServer publishes
# KV events (default_epp_config).
DEFAULT_EPP_CONFIG = DEFAULT_CONFIG_YAML
KVGATE_EPP_CONFIG = KVGATE_PROFILE_YAML

# Exactly what the EPP reads (epp/k8s_watch.py): its pool, the pool's pods, and the pool's policies.
EPP_RBAC_RULES = [
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": [naming.INFERENCE_GROUP], "resources": ["inferencepools"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": [naming.INFERENCE_X_GROUP], "resources": ["inferenceobjectives", "inferencemodelrewrites"],
     "verbs": ["get", "list", "watch"]},
]


def epp_replicas(pool: dict) -> int:
    """The EPP replicas the pool asks for (annotation kvgate.dev/epp-replicas); ValueError saying why a value is
    not usable. More than one: active-passive, the leader elected over a Lease (epp/leader.py)."""
    value = ((pool.get("metadata") or {}).get("annotations") or {}).get(REPLICAS_ANNOTATION)
    if value is None:
        return 1
    if not isinstance(value, str) or not value.isdigit() or not 1 <= int(value) <= MAX_EPP_REPLICAS:
        raise ValueError(f"annotation {REPLICAS_ANNOTATION}={str(value)[:40]!r}: expected a whole number from 1 "
                         f"to {MAX_EPP_REPLICAS}")
    return int(value)


def epp_ref(pool: dict) -> dict:
    """spec.endpointPickerRef; {} when it is not a mapping (spec_shape.py reports that)."""
    spec = pool.get("spec")
    ref = spec.get("endpointPickerRef") if isinstance(spec, Mapping) else None
    return ref if isinstance(ref, Mapping) else {}


def epp_service_port(pool: dict) -> int:
    return int((epp_ref(pool).get("port") or {}).get("number") or naming.EPP_GRPC_PORT)


def is_fail_open(pool: dict) -> bool:
    return epp_ref(pool).get("failureMode") == "FailOpen"


def _refers_to_service(pool: dict) -> bool:
    ref = epp_ref(pool)
    return bool(ref.get("name")) and ref.get("group", "") == "" and ref.get("kind", "Service") == "Service"


def manages_epp(pool: dict, existing_service: dict | None, modelservers: list[dict]) -> bool:
    """Whether the operator runs this pool's EPP (see the module docstring for the rule)."""
    mode = ((pool.get("metadata") or {}).get("annotations") or {}).get(EPP_ANNOTATION)
    joined = any(pool_ref_name(ms) == naming.name_of(pool)
                 and naming.namespace_of(ms) == naming.namespace_of(pool) for ms in modelservers)
    if mode == "external" or not (mode == "managed" or joined) or not _refers_to_service(pool):
        return False
    if existing_service is None:
        return True
    return naming.is_managed(existing_service) and naming.is_owned_by(existing_service, pool)


# --- the EPP's objects ---------------------------------------------------------------------------------------

def _epp_labels(pool: dict) -> dict[str, str]:
    return naming.component_labels("epp", naming.name_of(pool))


def _service_account(pool: dict) -> dict:
    return {"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": naming.object_meta(naming.epp_name(pool), pool, _epp_labels(pool))}


def _role(pool: dict, replicas: int = 1) -> dict:
    rules = [dict(rule) for rule in EPP_RBAC_RULES]
    if replicas > 1:  # leader election: its one Lease (create cannot be limited to a name)
        name = lease_name(naming.namespace_of(pool), naming.name_of(pool))
        rules += [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
                  {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": [name],
                   "verbs": ["get", "update"]}]
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": naming.object_meta(naming.epp_name(pool), pool, _epp_labels(pool)), "rules": rules}


def _role_binding(pool: dict) -> dict:
    name = naming.epp_name(pool)
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": naming.object_meta(name, pool, _epp_labels(pool)),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": naming.namespace_of(pool)}]}


def _config_map(pool: dict, config_yaml: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": naming.object_meta(naming.epp_name(pool), pool, _epp_labels(pool)),
            "data": {CONFIG_KEY: config_yaml}}


# Deletion (a rollout's old pod): first a preStop sleep while the EPP still answers SERVING, so that the Gateways
# learn of the new pod before the old one says NOT_SERVING — Envoy's gRPC health check takes a NOT_SERVING
# host out at its next check (1 s; the unhealthy threshold counts only network failures), and with
# --epp-address-mode pod-ip the new pod reaches Envoy only after the operator re-renders its EDS file and the
# kubelet publishes it (without the sleep, requests are answered 500 "no healthy upstream" in between;
# tests/e2e/test_rollout_e2e.py). Then on SIGTERM the EPP drains (epp/shutdown.py drain: a
# lame duck while streams keep coming — until Envoy's endpoint list names the new pod, in pod-ip mode —, then the
# streams it carries finish; all within --shutdown-timeout); the kubelet's SIGKILL comes after that and a margin to
# exit.
EPP_PRE_STOP_SLEEP_S = 5
EPP_SHUTDOWN_TIMEOUT_S = 60
EPP_TERMINATION_GRACE_S = EPP_PRE_STOP_SLEEP_S + EPP_SHUTDOWN_TIMEOUT_S + 10


def epp_command(pool: dict, behind_service: bool = True, tokenizer: str | None = None,
                ha: bool = False) -> list[str]:
    """Behind its Service (the operator's default address mode) the draining EPP keeps answering SERVING: Envoy's
    one host for it is the Service, kept on the old pod by its health-check connection, and NOT_SERVING there
    would fail the whole pool over while the new pod serves. Addressed by pod IP, each pod is its own host and
    NOT_SERVING takes just the old one out. It logs at info (the CLI's default is warning): pool changes, readiness
    and leadership changes belong in a pod's log."""
    return ["kvgate", "--log-level", "info", "epp", "--pool-name", naming.name_of(pool), "--pool-namespace", naming.namespace_of(pool),
            "--grpc-host", "0.0.0.0", "--grpc-port", str(naming.EPP_GRPC_PORT),
            "--grpc-health-port", str(naming.EPP_HEALTH_PORT), "--metrics-port", str(naming.EPP_METRICS_PORT),
            "--config-file", CONFIG_FILE, "--shutdown-timeout", str(EPP_SHUTDOWN_TIMEOUT_S),
            "--drain-health", "serving" if behind_service else "not-serving",
            *(["--tokenizer", tokenizer] if tokenizer else []), *(["--ha-enable-leader-election"] if ha else [])]


def _epp_container(pool: dict, image: str, behind_service: bool, tokenizer: "EppTokenizer",
                   ha: bool = False, tracing: "TraceExport | None" = None) -> dict:
    # Kubernetes 1.20 has no gRPC probes: the probes check the health port's socket. Envoy itself
    # health-checks the EPP over gRPC (envoy_config), so traffic never depends on these probes alone.
    return {
        "name": "epp",
        "image": image,
        "command": epp_command(pool, behind_service, tokenizer.path, ha),
        "ports": [{"name": "grpc", "containerPort": naming.EPP_GRPC_PORT, "protocol": "TCP"},
                  {"name": "grpc-health", "containerPort": naming.EPP_HEALTH_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": naming.EPP_METRICS_PORT, "protocol": "TCP"}],
        "env": [{"name": "HOME", "value": "/tmp"}, {"name": "PYTHONUNBUFFERED", "value": "1"},
                *(tracing.env("kvgate-epp") if tracing is not None else [])],
        # Exec, not the `sleep` lifecycle action: that needs Kubernetes 1.30 (the e2e rig runs 1.20).
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(EPP_PRE_STOP_SLEEP_S)]}}},
        "readinessProbe": {"tcpSocket": {"port": "grpc-health"}, "periodSeconds": 5, "timeoutSeconds": 2},
        "livenessProbe": {"tcpSocket": {"port": "grpc-health"}, "initialDelaySeconds": 5, "periodSeconds": 10,
                          "timeoutSeconds": 2, "failureThreshold": 3},
        "volumeMounts": [{"name": "config", "mountPath": "/config", "readOnly": True},
                         {"name": "tmp", "mountPath": "/tmp"}, *tokenizer.mounts],
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}},
    }


def epp_config_digest(config_yaml: str) -> str:
    """The EPP pods' config annotation, and the digest its status names: of the EndpointPickerConfig's text."""
    return hashlib.sha256(config_yaml.encode()).hexdigest()[:16]


def _deployment(pool: dict, image: str, config_yaml: str, behind_service: bool, tokenizer: "EppTokenizer",
                replicas: int = 1, tracing: "TraceExport | None" = None, leader_election: bool | None = None) -> dict:
    name = naming.epp_name(pool)
    selector = naming.selector_labels("epp", naming.name_of(pool))
    # Replicas beyond one are followers: warm (watching, scraping), live, and NOT_SERVING on the gRPC readiness
    # service Envoy health-checks until they lead. The kubelet's probe stays the socket's, so a rollout is not
    # stuck behind a new pod that cannot lead while the old one holds the Lease.
    spread = {"affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 100, "podAffinityTerm": {"labelSelector": {"matchLabels": selector},
                                            "topologyKey": "kubernetes.io/hostname"}}]}}} if replicas > 1 else {}
    # The EPP reads its config file once: a changed config must roll the pods, hence its digest on the template.
    pod_annotations = {"kvgate.dev/config-digest": epp_config_digest(config_yaml),
                       "prometheus.io/scrape": "true", "prometheus.io/port": str(naming.EPP_METRICS_PORT)}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": naming.object_meta(name, pool, _epp_labels(pool)),
        "spec": {
            "replicas": replicas,  # one serves at a time (leader election when more)
            # A config change starts the new pod first and removes the old one once the new one is ready.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": _epp_labels(pool), "annotations": pod_annotations},
                "spec": {
                    "serviceAccountName": name,
                    "containers": [_epp_container(pool, image, behind_service, tokenizer,
                                                  replicas > 1 if leader_election is None else leader_election,
                                                  tracing)],
                    "volumes": [{"name": "config", "configMap": {"name": name}}, {"name": "tmp", "emptyDir": {}},
                                *tokenizer.volumes],
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                    "terminationGracePeriodSeconds": EPP_TERMINATION_GRACE_S,
                    **spread,
                },
            },
        },
    }


def pod_disruption_budget(pool: dict, api_version: str = "policy/v1") -> dict:
    """With several replicas: voluntary disruptions (drains, upgrades) take one EPP pod at a time."""
    return {"apiVersion": api_version, "kind": "PodDisruptionBudget",
            "metadata": naming.object_meta(naming.epp_name(pool), pool, _epp_labels(pool)),
            "spec": {"maxUnavailable": 1,
                     "selector": {"matchLabels": naming.selector_labels("epp", naming.name_of(pool))}}}


def _service(pool: dict) -> dict:
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": naming.object_meta(epp_ref(pool)["name"], pool, _epp_labels(pool)),
        "spec": {
            "type": "ClusterIP",
            "selector": naming.selector_labels("epp", naming.name_of(pool)),
            "ports": [
                {"name": "grpc", "port": epp_service_port(pool), "targetPort": "grpc", "protocol": "TCP",
                 "appProtocol": "kubernetes.io/h2c"},
                {"name": "grpc-health", "port": naming.EPP_HEALTH_PORT, "targetPort": "grpc-health",
                 "protocol": "TCP", "appProtocol": "kubernetes.io/h2c"},
                {"name": "metrics", "port": naming.EPP_METRICS_PORT, "targetPort": "metrics", "protocol": "TCP",
                 "appProtocol": "http"},
            ],
        },
    }


def epp_problems(pool: dict, config_yaml: str | None) -> list[dict]:
    """Why no EPP can be made for `pool` ({reason, message}); empty when it can."""
    shape = pool_problems(pool)
    if shape:
        return [{"reason": "InvalidSpec", "message": "; ".join(shape)}]
    problems = []
    if not _refers_to_service(pool):
        problems.append({"reason": "InvalidExtensionRef", "message": "endpointPickerRef is not a core Service"})
    elif epp_service_port(pool) in (naming.EPP_HEALTH_PORT, naming.EPP_METRICS_PORT):
        problems.append({"reason": "InvalidExtensionRef",
                         "message": f"endpointPickerRef port {epp_service_port(pool)} collides with the EPP's "
                                    f"health ({naming.EPP_HEALTH_PORT}) or metrics ({naming.EPP_METRICS_PORT}) port"})
    if config_yaml is not None:
        try:
            parse_config(config_yaml, source="EndpointPickerConfig")
        except ConfigError as exc:
            problems.append({"reason": "InvalidConfig", "message": str(exc)})
    return problems


def desired_epp_objects(pool: dict, image: str, config_yaml: str | None = None, behind_service: bool = True,
                        tokenizer: "EppTokenizer | None" = None) -> list[dict]:
    """ServiceAccount, Role, RoleBinding, ConfigMap, Deployment and Service of the pool's EPP, in the order
    they are best applied; [] when `epp_problems` finds the pool unusable (its status says why). `behind_service`:
    the Gateways reach the EPP through its Service (not by pod IP). `tokenizer`: `epp_tokenizer`'s answer."""
    if epp_problems(pool, config_yaml):
        return []
    return render_epp_objects(pool, image, config_yaml if config_yaml is not None else DEFAULT_EPP_CONFIG,
                              behind_service, tokenizer)


def render_epp_objects(pool: dict, image: str, config_yaml: str, behind_service: bool = True,
                       tokenizer: "EppTokenizer | None" = None, replicas: int = 1,
                       tracing: "TraceExport | None" = None, active_active: bool = False) -> list[dict]:
    """desired_epp_objects without its checks, for a caller that made them already: a pool without
    `epp_problems(pool, None)` and a config that parses (the reconciler parses each config once). `replicas` > 1:
    leader election (the Role's Lease rules, the flag) and a PodDisruptionBudget (applied by the caller, which
    knows the cluster's policy API version). `tracing`: the EPP exports request spans there (its OTEL_* env).
    `active_active` (with `replicas` > 1): every replica serves, synced by peer sync instead of a Lease
    (epp_peer_sync.py; the caller creates its key Secret)."""
    active_active = active_active and replicas > 1
    deployment = _deployment(pool, image, config_yaml, behind_service, tokenizer or EppTokenizer(), replicas, tracing,
                             leader_election=replicas > 1 and not active_active)
    if active_active:
        deployment = with_peer_sync(deployment, pool)
    return [_service_account(pool), _role(pool, 1 if active_active else replicas),  # no Lease without an election
            _role_binding(pool), _config_map(pool, config_yaml), deployment, _service(pool)]


# --- the tokenizer of a precise EPP ---------------------------------------------------------------------------

PRECISE_SCORER = "precise-prefix-cache-scorer"


class EppTokenizer(NamedTuple):
    """Where the EPP reads the pool model's tokenizer: the model's volume, mounted read-only at the path the
    engines load it from, and `--tokenizer` that path. Empty: the EPP needs none, or its built-in default (the
    byte tokenizer of `demo` and of `--backend sim`) is the engines' own."""

    path: str | None = None
    volumes: tuple[dict, ...] = ()
    mounts: tuple[dict, ...] = ()
    problem: dict | None = None  # {reason, message}: the tokenizer could not be chosen (the EPP runs without)


def epp_tokenizer(config_yaml: str | None, pool: dict, modelservers: list[dict]) -> EppTokenizer:
    """epp_tokenizer_for_config of the config `config_yaml` (None: no config, no tokenizer)."""
    return epp_tokenizer_for_config(None if config_yaml is None else parse_config(config_yaml), pool, modelservers)


def epp_tokenizer_for_config(config: EppConfig | None, pool: dict, modelservers: list[dict]) -> EppTokenizer:
    """The tokenizer the pool's EPP needs: only a config with a precise-prefix-cache-scorer that names no
    `tokenizer` of its own needs one (every other scorer works on text, and the EPP then mounts nothing of the
    model: least privilege). It is the tokenizer of the model the pool's ModelServers load from a volume
    (pvc, hostPath or image; a PVC must allow a second, read-only reader — ReadOnlyMany or an image volume).
    ModelServers that load different models leave the EPP without one, with a problem saying so: one tokenizer
    cannot match two models, and a wrong one would only make every lookup miss."""
    if config is None:
        return EppTokenizer()
    scorers = [p for p in config.scheduler.plugins.values()
               if p.type_name == PRECISE_SCORER and p.tokenizer_path is None]
    if not scorers:
        return EppTokenizer()
    models = {}
    for ms in pool_modelservers(pool, modelservers):
        model = (ms.get("spec") or {}).get("model") or {}
        volume = model_volume(model)
        key = repr((volume, model.get("path") or DEFAULT_MODEL))
        models.setdefault(key, (naming.name_of(ms), volume, model.get("path") or DEFAULT_MODEL))
    if len(models) > 1:
        names = ", ".join(sorted(name for name, _, _ in models.values()))
        return EppTokenizer(problem={"reason": "TokenizerConflict", "message": (
            f"the pool's ModelServers ({names}) load different models, and its {PRECISE_SCORER} needs one "
            "tokenizer: give the scorer a `tokenizer` parameter, or put one model in the pool")})
    if not models:
        return EppTokenizer()
    _, volume, path = next(iter(models.values()))
    if volume is None:  # `demo` or a model inside the engine image: the EPP's default byte tokenizer or none
        return EppTokenizer()
    volume = {**volume, "name": "model"}
    return EppTokenizer(path=path, volumes=(volume,), mounts=({"name": "model", "mountPath": path, "readOnly": True},))


# --- the EPP's config ---------------------------------------------------------------------------------------

# A ConfigMap's name is a DNS subdomain; its keys are [-._a-zA-Z0-9]+ (both at most 253 characters).
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_CONFIG_KEY = re.compile(r"[-._a-zA-Z0-9]+")


def config_ref(pool: dict) -> tuple[str, str] | None:
    """(ConfigMap name, key) named by the pool's `kvgate.dev/epp-config` annotation; None without one.
    ValueError saying what is wrong when the annotation is malformed."""
    value = ((pool.get("metadata") or {}).get("annotations") or {}).get(CONFIG_ANNOTATION)
    if value is None:
        return None
    name, _, key = value.strip().partition("/")
    key = key or CONFIG_KEY
    if not (len(name) <= 253 and _DNS_SUBDOMAIN.fullmatch(name)):
        raise ValueError(f"annotation {CONFIG_ANNOTATION}={value!r}: {name!r} is not a ConfigMap name "
                         "(expected <configmap>[/<key>], the ConfigMap in the pool's namespace)")
    if not (len(key) <= 253 and _CONFIG_KEY.fullmatch(key)):
        raise ValueError(f"annotation {CONFIG_ANNOTATION}={value!r}: {key!r} is not a ConfigMap key")
    return name, key


def referenced_config_name(pool: dict) -> str | None:
    """The ConfigMap the reconciler reads for the pool's config; None without a (well-formed) reference."""
    try:
        ref = config_ref(pool)
    except ValueError:
        return None
    return ref[0] if ref else None


@dataclass(frozen=True)
class ConfigChoice:
    config_yaml: str | None  # what the EPP is to run; None: nothing usable, so no EPP is made or changed
    source: str  # where it comes from, for the status
    problem: dict | None  # {reason, message} when the pool's config reference or its config is unusable
    # config_yaml parsed (None with it), so that a reconcile parses it once; derived from it, so not compared.
    parsed: EppConfig | None = field(default=None, compare=False, repr=False)


def _last_good(pool: dict, current: dict | None) -> tuple[str | None, EppConfig | None]:
    """The config in the EPP's own ConfigMap (the last one rolled out), and its parse, when it is the
    operator's and parses; else (None, None)."""
    if not (naming.is_managed(current) and naming.is_owned_by(current, pool)):
        return None, None
    text = (current.get("data") or {}).get(CONFIG_KEY)
    try:
        return text, parse_config(text or "", source="the EPP's ConfigMap")
    except ConfigError:
        return None, None


def running_epp_config(epp_config_map: dict | None, pool: dict) -> EppConfig | None:
    """The config the pool's EPP runs, parsed (the last good one in its ConfigMap), when that EPP is the operator's;
    None when its config is not known here. Parse once per pool and ask `returns_lists` / `response_needs`."""
    return _last_good(pool, epp_config_map)[1]


def returns_lists(config: EppConfig | None) -> bool:
    """Whether the pool's EPP (its `running_epp_config`) answers with a list of endpoints (its primary picker's
    maxNumOfEndpoints > 1): the Gateways then route the pool through override_host, whose retries walk the list.
    False for an EPP whose config is not known (upstream's default answers one endpoint)."""
    return config is not None and config.returns_lists


def response_needs(config: EppConfig | None) -> str:
    """What of a response the pool's EPP (its `running_epp_config`) reads (envoy_config.RESPONSE_NEEDS): the
    Gateways send it no more. The body for an EPP whose config is not known (its bodies stream through it, as
    upstream's do)."""
    return RESPONSE_BODY if config is None else config.response_needs


def pool_modelservers(pool: dict, modelservers: list[dict]) -> list[dict]:
    """The ModelServers (of `modelservers`) that join `pool`."""
    return [ms for ms in modelservers if pool_ref_name(ms) == naming.name_of(pool)
            and naming.namespace_of(ms) == naming.namespace_of(pool)]


def default_epp_config(pool: dict, modelservers: list[dict]) -> ConfigChoice:
    """kvgate's profile when the pool's replicas are all kvgate engines that publish KV events (ModelServers with
    spec.engine.kvEvents): its precise prefix scorer reads them, its affinity filter their exact prefill backlog —
    ahead of upstream's default at saturation (`kvgate bench routing --rates saturation --configs approximate,kvgate`;
    docs/benchmarks.md).
    Else upstream's default: other pods in the pool (or ModelServers without events) give it nothing to read."""
    members = pool_modelservers(pool, modelservers)
    if members and all(kv_events_ports(ms.get("spec") or {}) for ms in members):  # the sockets the EPP reads
        return ConfigChoice(KVGATE_EPP_CONFIG, "kvgate's profile (every ModelServer of the pool publishes KV events)",
                            None, parse_config(KVGATE_EPP_CONFIG))
    return ConfigChoice(DEFAULT_EPP_CONFIG, "the default EndpointPickerConfig", None, parse_config(DEFAULT_EPP_CONFIG))


def choose_epp_config(pool: dict, referenced: dict | None, current: dict | None,
                      modelservers: list[dict] = ()) -> ConfigChoice:
    """The config to roll out to the pool's EPP: without a `kvgate.dev/epp-config` annotation the default for its
    ModelServers (default_epp_config), else the referenced ConfigMap's key once it parses. When the reference or
    the config is unusable: the last good config (`current`, the EPP's own ConfigMap) with the problem, so the
    EPP never gets a config it would refuse, nor silently the default in place of the one asked for."""
    try:
        ref = config_ref(pool)
    except ValueError as exc:
        return _keep(pool, current, "InvalidConfigRef", str(exc))
    if ref is None:
        return default_epp_config(pool, modelservers)
    name, key = ref
    if referenced is None:
        return _keep(pool, current, "ConfigMapNotFound",
                     f"ConfigMap {name!r} (annotation {CONFIG_ANNOTATION}) not found in namespace "
                     f"{naming.namespace_of(pool)!r}")
    data = referenced.get("data") or {}
    if key not in data:
        return _keep(pool, current, "ConfigKeyNotFound",
                     f"ConfigMap {name!r} has no key {key!r} (keys: {', '.join(sorted(data)) or 'none'})")
    source = f"ConfigMap {name!r} key {key!r}"
    try:
        parsed = parse_config(data[key], source=source)
    except ConfigError as exc:
        return _keep(pool, current, "InvalidConfig", str(exc))
    return ConfigChoice(data[key], f"the EndpointPickerConfig of {source}", None, parsed)


def _keep(pool: dict, current: dict | None, reason: str, message: str) -> ConfigChoice:
    text, parsed = _last_good(pool, current)
    return ConfigChoice(text, "its last good config", {"reason": reason, "message": message}, parsed)


def running_note(choice: ConfigChoice, rolled_out: bool) -> str:
    """What the EPP runs, for the status: the config's source and digest, or that nothing was rolled out."""
    if not rolled_out or choice.config_yaml is None:
        return "The EPP is not created or updated until this is fixed."
    verb = "keeps" if choice.problem else "runs"
    return f"The EPP {verb} {choice.source} (config digest {epp_config_digest(choice.config_yaml)})."


def epp_pool_status(pool: dict, problems: list[dict], running: str, now: str | None = None) -> dict:
    """The pool's status.parents with the EPP's entry (controller kvgate.dev/endpoint-picker, parentRef the EPP
    Deployment) set: ResolvedRefs (the EPP Service and config references), Accepted (everything asked of the
    EPP is rolled out); `running` says what the EPP runs. Other entries are kept as they are."""
    gen = (pool.get("metadata") or {}).get("generation")
    previous = (pool.get("status") or {}).get("parents") or []
    old = next((p for p in previous if p.get("controllerName") == EPP_CONTROLLER_NAME), {})
    refs = [p for p in problems if p["reason"] in REF_REASONS]
    resolved = (condition("ResolvedRefs", False, refs[0]["reason"], "; ".join(p["message"] for p in refs), gen)
                if refs else condition("ResolvedRefs", True, "ResolvedRefs", "the EPP's references resolve", gen))
    accepted = (condition("Accepted", False, problems[0]["reason"],
                          "; ".join(p["message"].rstrip(". ") for p in problems) + f". {running}", gen)
                if problems else condition("Accepted", True, "Accepted", running, gen))
    entry = {"parentRef": {"group": "apps", "kind": "Deployment", "name": naming.epp_name(pool),
                           "namespace": naming.namespace_of(pool)},
             "controllerName": EPP_CONTROLLER_NAME,
             "conditions": stamp([accepted, resolved], old.get("conditions"), now)}
    # First, where pool_status (the Gateways' writer, which keeps other entries in their order) leaves it too:
    # two writers that ordered the list differently would rewrite it back and forth forever.
    others = [p for p in previous if p.get("controllerName") != EPP_CONTROLLER_NAME]
    return {"parents": [entry] + others}


def without_epp_status(pool: dict) -> dict | None:
    """The pool's status.parents without the EPP's entry; None when it has none (nothing to write)."""
    previous = (pool.get("status") or {}).get("parents") or []
    kept = [p for p in previous if p.get("controllerName") != EPP_CONTROLLER_NAME]
    return None if len(kept) == len(previous) else {"parents": kept}


# --- status.parents ------------------------------------------------------------------------------------------

def epp_resolution(pool: dict, service: dict | None) -> tuple[bool, str]:
    """(resolved, message) of the pool's endpointPickerRef against the Service that exists (or None)."""
    ref = epp_ref(pool)
    if not ref.get("name"):
        return False, "endpointPickerRef is not set"
    if not _refers_to_service(pool):
        return False, f"unsupported endpointPickerRef kind {ref.get('group', '')}/{ref.get('kind')}"
    if service is None:
        return False, f"Service {ref['name']!r} not found in namespace {naming.namespace_of(pool)!r}"
    spec = service.get("spec") or {}
    if spec.get("type") == "ExternalName":
        return False, f"Service {ref['name']!r} is of type ExternalName"
    if epp_service_port(pool) not in [p.get("port") for p in spec.get("ports") or []]:
        return False, f"Service {ref['name']!r} has no port {epp_service_port(pool)}"
    return True, "the endpoint picker Service resolves"


def _parent_ref(gateway: dict) -> dict:
    return {"group": naming.GATEWAY_GROUP, "kind": "Gateway", "name": naming.name_of(gateway),
            "namespace": naming.namespace_of(gateway)}


def _same_parent(entry: dict, ref: dict) -> bool:
    got = entry.get("parentRef") or {}
    return (got.get("group", naming.GATEWAY_GROUP), got.get("kind", "Gateway"), got.get("name"),
            got.get("namespace")) == (ref["group"], ref["kind"], ref["name"], ref["namespace"])


def pool_status(pool: dict, gateways_referencing: list[dict], epp_service: dict | None,
                now: str | None = None, controller_name: str = naming.CONTROLLER_NAME) -> dict:
    """The pool's status: one parents entry per Gateway of ours whose accepted HTTPRoutes use the pool.

    Entries of other controllers are kept untouched; ours for Gateways that no longer use the pool are
    dropped (upstream conformance expects no parents once no route references the pool)."""
    gen = (pool.get("metadata") or {}).get("generation")
    previous = (pool.get("status") or {}).get("parents") or []
    resolved, message = epp_resolution(pool, epp_service)
    ours = []
    for gateway in sorted(gateways_referencing, key=naming.key_of):
        ref = _parent_ref(gateway)
        old = next((p for p in previous if _same_parent(p, ref)), {})
        conds = [condition("Accepted", True, "Accepted", f"referenced by an HTTPRoute of Gateway {ref['name']}", gen),
                 condition("ResolvedRefs", resolved, "ResolvedRefs" if resolved else "InvalidExtensionRef",
                           message, gen)]
        ours.append({"parentRef": ref, "controllerName": controller_name,
                     "conditions": stamp(conds, old.get("conditions"), now)})
    others = [p for p in previous if p.get("controllerName") != controller_name]
    return {"parents": others + ours}
