"""ModelServer → a Deployment of engine pods that are members of the ModelServer's InferencePool.

The engine is spec.engine.type's: `kvgate serve` (the default), `vllm serve` or SGLang's launch_server, each
with its own command line from the same fields (engine_commands.py) and, for vLLM and SGLang, their own image
(spec.image, or the operator's --vllm-image / --sglang-image) and the engine-type pod label by which the EPP
reads their metric names (SGLang's differ from vLLM's; kvgate's engine exports vLLM's).

The pods carry the pool's selector labels and serve on the pool's first target port, so the pool (and its
EPP) picks them up with no further wiring. The root filesystem is read-only: the engine writes only to its
cache dir (the demo model, compiled kernels) and /tmp, both emptyDirs; vLLM and SGLang, whose images run as
root with caches under root's HOME, get HOME, XDG, Hugging Face, Triton, inductor and vLLM cache variables
pointing there (engine_env).

Security: the pods run as the image's own non-root user (uid 10001, the Dockerfile's USER; set explicitly so
that an allowed override image whose USER is root cannot run as root), with no privilege escalation, every
capability dropped, the RuntimeDefault seccomp profile and no service-account token; what a tenant may add
(host mounts, other images, labels) is ruled by tenancy.py.

Drain (a rolling update or scale-down): the kubelet runs the preStop hook (a short sleep) first, while the pod
still serves: by then its deletion has reached the EPP's pod watch (and the Gateways' FailOpen fallback
lists), so no new request is routed to it when the engine gets SIGTERM. The engine then turns /health 503,
admits nothing new and finishes its streams within `--shutdown-timeout` (vLLM's flag; spec.engine.
shutdownGracePeriodSeconds; SGLang has no such flag and stops at SIGTERM, so for it only the preStop pause
keeps new requests away); terminationGracePeriodSeconds covers the sleep, that grace and a margin to exit.
Liveness is /live: 200 while the model loads and while it drains, 503 only once the engine loop died (and by
default the server then exits, so the container restarts at once); the kubelet also stops liveness probes once
a pod is being deleted, so a draining engine is never restarted. vLLM and SGLang have no /live: their liveness
is /health, behind the same startup probe.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from kvgate.common.epp_protocol import (ENGINE_TYPE_LABEL, KV_EVENTS_PORT_ANNOTATION,
                                        KV_EVENTS_REPLAY_PORT_ANNOTATION)
from kvgate.operator import naming
from kvgate.operator.autoscaling_spec import autoscaler_conditions, autoscaling_problems, rendered_replicas
from kvgate.operator.conditions import condition, find, stamp
from kvgate.operator.config import TraceExport
from kvgate.operator.engine_commands import (ADAPTERS_DIR, DEFAULT_MODEL, KVGATE, OPERATOR_FLAGS, QUANTIZATIONS,
                                             SGLANG, SPEC_FLAGS, VLLM, engine_problems, engine_type, kv_cache_bytes,
                                             serve_command, shutdown_grace_s)
from kvgate.operator.spec_shape import modelserver_problems, pool_problems, pool_ref_name
from kvgate.operator.tenancy import TenantPolicy, escalation_problems, label_problems

CACHE_DIR = "/var/cache/kvgate"
CONTAINER = "engine"
RUN_AS = 10001  # the kvgate image's USER (Dockerfile): files the image gives its user stay readable
# preStop sleep before SIGTERM: a pod watch event reaches the EPP in well under a second, an operator-rendered
# FailOpen fallback list within a reconcile; 5 s covers both with room, and is short against the drain grace.
PRE_STOP_SLEEP_S = 5
EXIT_MARGIN_S = 5  # after the drain grace, for the process to exit before the kubelet's SIGKILL
GPU_RESOURCE = "nvidia.com/gpu"
# A memory-backed /dev/shm for tensor-parallel ranks (torch.distributed's transfers between the ranks' processes
# use shared memory; the container runtime's default /dev/shm is 64Mi). It counts against the pod's memory.
SHM_SIZE = "1Gi"
API_KEY_ENV = "VLLM_API_KEY"  # what `kvgate serve` reads (engine/server/auth.py), as vLLM does
# spec.engine.apiKeySecretRef: a Secret's name (a DNS subdomain) and one of its keys, as the API server checks them
_SECRET_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_SECRET_KEY = re.compile(r"\.?[-_a-zA-Z0-9][-._a-zA-Z0-9]*")  # not "." nor ".." nor "..x"

# --- validation: what the CRD schema cannot say -------------------------------------------------------------

def _pool_problems(ms: dict, pool: dict | None) -> list[dict]:
    pool_name = pool_ref_name(ms) or ""
    if pool is None:
        return [{"reason": "PoolNotFound",
                 "message": f"InferencePool {pool_name!r} not found in namespace {naming.namespace_of(ms)!r}"}]
    shape = pool_problems(pool)
    if shape:
        return [{"reason": "PoolInvalid", "message": f"InferencePool {pool_name!r}: {'; '.join(shape)}"}]
    spec = pool.get("spec") or {}
    problems = []
    if not (spec.get("selector") or {}).get("matchLabels"):
        problems.append({"reason": "PoolInvalid", "message": f"InferencePool {pool_name!r} has no selector labels"})
    if not spec.get("targetPorts"):
        problems.append({"reason": "PoolInvalid", "message": f"InferencePool {pool_name!r} has no targetPorts"})
    return problems


def _spec_problems(ms: dict) -> list[dict]:
    spec = ms.get("spec") or {}
    model = spec.get("model") or {}
    problems = []
    sources = [k for k in ("pvc", "hostPath", "image") if model.get(k)]
    if len(sources) > 1:
        problems.append({"reason": "InvalidSpec", "message": f"more than one model volume source: {sources}"})
    if sources and not str(model.get("path", DEFAULT_MODEL)).startswith("/"):
        problems.append({"reason": "InvalidSpec", "message": "model.path must be absolute with a volume source"})
    kv = (spec.get("engine") or {}).get("kvCacheMemory")
    if kv is not None:
        try:
            kv_cache_bytes(kv)
        except ValueError as exc:
            problems.append({"reason": "InvalidSpec", "message": f"engine.kvCacheMemory: {exc}"})
    if not isinstance(spec.get("extraArgs", []), list):
        problems.append({"reason": "InvalidSpec", "message": "extraArgs must be a list of strings"})
    else:
        flags = {str(a).split("=", 1)[0] for a in spec.get("extraArgs") or []}
        kind = engine_type(spec) if engine_type(spec) in OPERATOR_FLAGS else KVGATE
        taken = sorted(flags & set(OPERATOR_FLAGS[kind]))
        spec_owned = sorted({f"{flag} (set {field})" for flag, field in SPEC_FLAGS[kind].items()
                             if any(len(f) > 2 and flag.startswith(f) for f in flags)})
        if spec_owned:
            problems.append({"reason": "InvalidSpec",
                             "message": f"extraArgs may not set {', '.join(spec_owned)}: the pod's resources and "
                                        "volumes follow those fields"})
        if taken:
            problems.append({"reason": "InvalidSpec",
                             "message": f"extraArgs may not set {', '.join(taken)}: the operator sets them (the "
                                        "pool's port; model.path; spec.engine.shutdownGracePeriodSeconds)"})
        # argparse takes any unambiguous prefix of a flag, so `--api` is `--api-key` too.
        if any(len(f) > 2 and "--api-key".startswith(f) for f in flags):
            problems.append({"reason": "InvalidSpec",
                             "message": "extraArgs may not set --api-key: a key there is readable by anyone who "
                                        "can read the ModelServer, its Deployment or its pods; put it in a Secret "
                                        "and name it in spec.engine.apiKeySecretRef"})
    problems += [{"reason": "InvalidSpec", "message": p} for p in engine_problems(spec)]
    if ENGINE_TYPE_LABEL in (spec.get("podLabels") or {}):
        problems.append({"reason": "InvalidSpec", "message": f"podLabels may not set {ENGINE_TYPE_LABEL}: the "
                         "operator sets it from engine.type (the EPP reads the engine's metrics by it)"})
    problems += _api_key_ref_problems(spec)
    problems += [{"reason": "InvalidSpec", "message": p} for p in autoscaling_problems(spec)]
    problems += _parallelism_problems(spec)
    lookup = (spec.get("engine") or {}).get("speculativeConfig") or {}
    if (lookup.get("promptLookupMin") or 0) > (lookup.get("promptLookupMax") or float("inf")):
        problems.append({"reason": "InvalidSpec", "message": "engine.speculativeConfig: promptLookupMin "
                         f"({lookup['promptLookupMin']}) must be <= promptLookupMax ({lookup['promptLookupMax']})"})
    return problems


def tensor_parallel_size(spec: dict) -> int:
    return int((spec.get("engine") or {}).get("tensorParallelSize") or 1)


def requests_gpus(spec: dict) -> bool:
    """Whether the pod asks for tensorParallelSize GPUs itself: above 1, unless the engine runs on the CPU."""
    return tensor_parallel_size(spec) > 1 and (spec.get("engine") or {}).get("device") != "cpu"


def _parallelism_problems(spec: dict) -> list[dict]:
    """engine.quantization spelled as the engine takes it; engine.tensorParallelSize consistent with the device
    and with a GPU count given in resources."""
    engine = spec.get("engine") or {}
    problems = []
    if engine.get("quantization") is not None and engine["quantization"] not in QUANTIZATIONS:
        problems.append(f"quantization {str(engine['quantization'])[:40]!r} is not one of {', '.join(QUANTIZATIONS)}")
    size = tensor_parallel_size(spec)
    if size > 1 and str(engine.get("device") or "").startswith("cuda:"):
        problems.append(f"device {engine['device']!r} names one GPU; with tensorParallelSize {size} use cuda or "
                        "auto (rank r runs on GPU r of the pod)")
    if requests_gpus(spec):
        for kind in ("limits", "requests"):
            given = ((spec.get("resources") or {}).get(kind) or {}).get(GPU_RESOURCE)
            if given is not None and str(given) != str(size):
                problems.append(f"resources.{kind}[{GPU_RESOURCE}] is {given!r} but tensorParallelSize is {size} "
                                "(one GPU a rank; leave it out and the operator requests them)")
    return [{"reason": "InvalidSpec", "message": f"engine: {p}"} for p in problems]


def _api_key_ref_problems(spec: dict) -> list[dict]:
    """spec.engine.apiKeySecretRef spelled as the API server would take it in a pod's secretKeyRef (else the
    Deployment would be rejected, or its pods never start, with a less direct message)."""
    ref = (spec.get("engine") or {}).get("apiKeySecretRef")
    if not ref:
        return []
    problems = []
    if len(ref["name"]) > 253 or not _SECRET_NAME.fullmatch(ref["name"]):
        problems.append(f"name {ref['name'][:253]!r} is not a Secret name (lower-case letters, digits, '-' and "
                        "'.', at most 253)")
    if len(ref["key"]) > 253 or not _SECRET_KEY.fullmatch(ref["key"]):
        problems.append(f"key {ref['key'][:253]!r} is not a Secret key (letters, digits, '-', '_' and '.', at "
                        "most 253, not '.' or '..'-prefixed)")
    return [{"reason": "InvalidSpec", "message": f"engine.apiKeySecretRef: {p}"} for p in problems]


_ADAPTER_NAME = re.compile(r"[A-Za-z0-9][-A-Za-z0-9_.:]*")


def _lora_problems(ms: dict) -> list[dict]:
    """spec.engine.lora's rules beyond its shape (the CRD's patterns and CEL rule, checked again for clusters that
    do not run them): adapter names unique, not the served model's, spelled as the CRD says; paths inside the
    adapters volume; one volume source; host copies at least the slots."""
    spec = ms.get("spec") or {}
    lora = (spec.get("engine") or {}).get("lora")
    if not lora:
        return []
    problems = []
    model = spec.get("model") or {}
    served = model.get("servedModelName") or model.get("path") or DEFAULT_MODEL
    names = [a["name"] for a in lora["adapters"]]
    bad = [n for n in names if not _ADAPTER_NAME.fullmatch(n) or n == served]
    if bad:
        problems.append(f"adapter names {bad} must match {_ADAPTER_NAME.pattern} and differ from the served model "
                        f"name {served!r}")
    if len(set(names)) != len(names):
        problems.append(f"adapter names must be unique, got {names}")
    outside = [a["path"] for a in lora["adapters"]
               if a["path"].startswith("/") or ".." in a["path"].split("/") or not a["path"].strip("/")]
    if outside:
        problems.append(f"adapter paths {outside} must be relative folders inside the adapters volume (no '..')")
    sources = [k for k in ("pvc", "image") if (lora.get("source") or {}).get(k)]
    if len(sources) != 1:
        problems.append(f"exactly one adapter volume source (pvc or image) must be set, got {sources or 'none'}")
    model_path = str(model.get("path") or DEFAULT_MODEL)
    if model_path == ADAPTERS_DIR or model_path.startswith(ADAPTERS_DIR + "/"):
        problems.append(f"model.path {model_path!r} is where the adapters are mounted ({ADAPTERS_DIR})")
    if lora.get("maxCpuLoras") is not None and lora["maxCpuLoras"] < lora.get("maxLoras", 1):
        problems.append(f"maxCpuLoras ({lora['maxCpuLoras']}) must be >= maxLoras ({lora.get('maxLoras', 1)})")
    return [{"reason": "InvalidSpec", "message": f"engine.lora: {p}"} for p in problems]


def lora_volume(lora: dict) -> dict:
    source = lora["source"]
    if source.get("pvc"):
        return {"name": "lora-adapters",
                "persistentVolumeClaim": {"claimName": source["pvc"]["claimName"], "readOnly": True}}
    image = {"reference": source["image"]["reference"]}
    if source["image"].get("pullPolicy"):
        image["pullPolicy"] = source["image"]["pullPolicy"]
    return {"name": "lora-adapters", "image": image}


def _kv_events_problems(ms: dict, pool: dict | None) -> list[dict]:
    kv_ports = [p for _, p, _ in kv_events_ports(ms.get("spec") or {})]
    usable_pool = pool and not pool_problems(pool) and (pool.get("spec") or {}).get("targetPorts")
    serving = [pool_port(pool)] if usable_pool else []  # (a misshapen pool is its own condition)
    if len(set(kv_ports + serving)) < len(kv_ports + serving):
        return [{"reason": "InvalidSpec", "message": f"engine.kvEvents: ports {kv_ports} must differ from each "
                                                     f"other and from the serving port {serving}"}]
    return []


OperatorImages = str | Mapping[str, str]  # the kvgate engine image, or the operator's image per engine type


def operator_images(images: OperatorImages | None) -> dict[str, str]:
    """The operator's default image per engine type (`kvgate operator --engine-image`, `--vllm-image`,
    `--sglang-image`); a bare string is the kvgate engine's."""
    if images is None:
        return {}
    return {k: v for k, v in images.items() if v} if isinstance(images, Mapping) else {KVGATE: images}


def _image_problems(ms: dict, images: dict[str, str]) -> list[dict]:
    """A vllm or sglang ModelServer runs that engine's image: spec.image, or the operator's for that type."""
    spec = ms.get("spec") or {}
    kind = engine_type(spec)
    if spec.get("image") or kind not in (VLLM, SGLANG) or images.get(kind):
        return []
    return [{"reason": "InvalidSpec",
             "message": f"engine.type {kind} needs a {kind} image: set spec.image (allowed by the operator's "
                        f"--allow-image-prefix) or start the operator with --{kind}-image"}]


def validate_modelserver(ms: dict, pool: dict | None, policy: TenantPolicy = TenantPolicy(),
                         other_pools: list[dict] = (), operator_image: OperatorImages | None = None) -> list[dict]:
    """Problems ({reason, message}) the schema cannot catch; empty when a Deployment can be made.

    Some of these the CRD's CEL rules also reject — they are checked again for clusters too old to run CEL
    (the e2e rig is Kubernetes 1.20). `policy`, `other_pools` (the namespace's other InferencePools) and
    `operator_image` (the engine image the operator runs by default, or its image per engine type) feed
    tenancy.py's rules; without it, whether a vllm or sglang ModelServer has an image is not judged."""
    shape = modelserver_problems(ms)
    if shape:  # nothing else can be judged (or rendered) from a spec of the wrong shape
        return [{"reason": "InvalidSpec", "message": "; ".join(shape)}] + _pool_problems(ms, pool)
    images = operator_images(operator_image)
    problems = (_pool_problems(ms, pool) + _spec_problems(ms) + _kv_events_problems(ms, pool) + _lora_problems(ms)
                + (_image_problems(ms, images) if operator_image is not None else [])
                + escalation_problems(ms, policy, images.get(engine_type(ms.get("spec") or {}))))
    if not problems:
        own = naming.key_of(pool)
        # A misshapen pool selects nothing (its own reconcile reports it).
        others = [p for p in other_pools if naming.key_of(p) != own and not pool_problems(p)]
        problems += label_problems(ms, _operator_pod_labels(ms, pool), engine_pod_labels(ms, pool), others)
    return problems


# --- the Deployment ------------------------------------------------------------------------------------------

def pool_labels(pool: dict) -> dict[str, str]:
    return dict(((pool.get("spec") or {}).get("selector") or {}).get("matchLabels") or {})


def pool_port(pool: dict) -> int:
    return int((pool.get("spec") or {}).get("targetPorts")[0]["number"])


def replicas_of(ms: dict) -> int:
    """The engine Deployment's replica count: spec.replicas (1 when unset or null, the CRD's default), or with
    autoscaling (spec.maxReplicas) the autoscaler's count (autoscaling_spec.py)."""
    return rendered_replicas(ms)


def api_key_env(engine: dict) -> list[dict]:
    """VLLM_API_KEY from spec.engine.apiKeySecretRef: a reference the kubelet resolves in the pod's own namespace
    (the ModelServer's), so the key is in no object the operator writes, and the operator never reads it. Not
    optional: without the Secret or its key the container does not start (CreateContainerConfigError)."""
    ref = engine.get("apiKeySecretRef")
    if not ref:
        return []
    return [{"name": API_KEY_ENV,
             "valueFrom": {"secretKeyRef": {"name": ref["name"], "key": ref["key"], "optional": False}}}]


def kv_events_ports(spec: dict) -> list[tuple[str, int, str]]:
    """(port name, port, pod annotation) for each KV-event socket spec.engine.kvEvents opens."""
    kv_events = (spec.get("engine") or {}).get("kvEvents") or {}
    named = [("kv-events", kv_events.get("port"), KV_EVENTS_PORT_ANNOTATION),
             ("kv-replay", kv_events.get("replayPort"), KV_EVENTS_REPLAY_PORT_ANNOTATION)]
    return [(name, int(port), annotation) for name, port, annotation in named if port]


def termination_grace_s(spec: dict) -> int:
    """The pod's terminationGracePeriodSeconds: the preStop sleep, the engine's drain grace, a margin to exit."""
    return PRE_STOP_SLEEP_S + shutdown_grace_s(spec) + EXIT_MARGIN_S


def model_volume(model: dict) -> dict | None:
    """The volume a ModelServer loads its model from (spec.model pvc / hostPath / image); None without one."""
    if model.get("pvc"):
        pvc = model["pvc"]
        return {"name": "model", "persistentVolumeClaim": {"claimName": pvc["claimName"],
                                                           "readOnly": pvc.get("readOnly", True)}}
    if model.get("hostPath"):
        return {"name": "model", "hostPath": {"path": model["hostPath"]["path"], "type": "Directory"}}
    if model.get("image"):
        image = {"reference": model["image"]["reference"]}
        if model["image"].get("pullPolicy"):
            image["pullPolicy"] = model["image"]["pullPolicy"]
        return {"name": "model", "image": image}
    return None


def _volumes(spec: dict) -> tuple[list[dict], list[dict]]:
    model = spec.get("model") or {}
    volumes = [{"name": "cache", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}]
    mounts = [{"name": "cache", "mountPath": CACHE_DIR}, {"name": "tmp", "mountPath": "/tmp"}]
    volume = model_volume(model)
    if volume:
        volumes.append(volume)
        mounts.append({"name": "model", "mountPath": model["path"], "readOnly": True})
    lora = (spec.get("engine") or {}).get("lora")
    if lora:
        volumes.append(lora_volume(lora))
        mounts.append({"name": "lora-adapters", "mountPath": ADAPTERS_DIR, "readOnly": True})
    if tensor_parallel_size(spec) > 1:
        volumes.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}})
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    return volumes, mounts


STARTUP_LIMIT_S = 1800  # the longest a model may take to load before the container is restarted


def _probes(port_name: str, kind: str = KVGATE) -> dict:
    # Startup and readiness are GET /health: 503 until the model is loaded, 200 while the engine serves, 503
    # once the engine loop died or a drain began. Liveness is GET /live, 503 only once the loop died. The startup
    # probe holds liveness off during a model load (up to STARTUP_LIMIT_S), probed every second so a new replica is
    # checked for readiness as soon as it is up.
    # Readiness every second (a /health answer costs microseconds): a replica joins the pool as soon as it is
    # up (tests/e2e/test_operator_e2e.py prints the scale-up time) and leaves it within ~3 s of turning 503.
    # Liveness restarts a container whose engine loop died (and which was told to stay up) within ~30 s (6
    # failures, 5 s apart) and tolerates /live being slow for ~25 s (a slow step starving the server). No gRPC
    # probes: the e2e rig runs Kubernetes 1.20.
    # vLLM and SGLang have no /live: their HTTP server listens only once the model is loaded, and /health answers
    # 200 while the engine runs (SGLang's /health_generate runs a generation: too dear for a probe every second).
    # Liveness is /health too, so an engine that died is restarted; the startup probe covers the load.
    health = {"httpGet": {"path": "/health", "port": port_name}}
    live = {"httpGet": {"path": "/live" if kind == KVGATE else "/health", "port": port_name}}
    return {
        "startupProbe": {**health, "periodSeconds": 1, "timeoutSeconds": 2, "failureThreshold": STARTUP_LIMIT_S},
        "readinessProbe": {**health, "periodSeconds": 1, "timeoutSeconds": 2, "failureThreshold": 3},
        "livenessProbe": {**live, "periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 6},
    }


def _only(mapping: dict, keys: tuple[str, ...]) -> dict:
    """The named fields of a user-supplied structure: the pod spec never carries a field the operator did not
    choose to pass (the API server prunes unknown fields too; this holds where a schema is looser)."""
    return {k: mapping[k] for k in keys if k in mapping}


# OTEL_SERVICE_NAME of each engine's spans (vLLM's and SGLang's own defaults name the process, not the engine).
TRACE_SERVICE_NAMES = {KVGATE: "kvgate-engine", VLLM: "vllm", SGLANG: "sglang"}


def engine_env(spec: dict, tracing: TraceExport | None = None) -> list[dict]:
    """The engine's environment: every cache it writes under the cache emptyDir or /tmp (the root filesystem is
    read-only; vLLM's and SGLang's images expect to write under root's HOME), a user name for the non-root uid
    (torch's compile cache asks getpass, which fails for a uid with no passwd entry), no usage reports; with
    `tracing` (the operator's --otlp-traces-endpoint) the standard OTEL_* variables: the collector, parent-based
    ratio sampling, the engine's service name."""
    env = [{"name": "KVGATE_CACHE_DIR", "value": CACHE_DIR}, {"name": "HOME", "value": "/tmp"},
           {"name": "PYTHONUNBUFFERED", "value": "1"}]
    if engine_type(spec) != KVGATE:
        env += [{"name": "USER", "value": "engine"}, {"name": "LOGNAME", "value": "engine"},
                {"name": "XDG_CACHE_HOME", "value": CACHE_DIR},
                {"name": "XDG_CONFIG_HOME", "value": f"{CACHE_DIR}/config"},
                {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
                {"name": "TRITON_CACHE_DIR", "value": f"{CACHE_DIR}/triton"},
                {"name": "TORCHINDUCTOR_CACHE_DIR", "value": f"{CACHE_DIR}/inductor"},
                {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"}, {"name": "DO_NOT_TRACK", "value": "1"}]
    if engine_type(spec) == VLLM:
        env += [{"name": "VLLM_CACHE_ROOT", "value": f"{CACHE_DIR}/vllm"},
                {"name": "VLLM_CONFIG_ROOT", "value": f"{CACHE_DIR}/vllm-config"},
                {"name": "VLLM_NO_USAGE_STATS", "value": "1"}]
    if tracing is not None:
        env += tracing.env(TRACE_SERVICE_NAMES.get(engine_type(spec), "kvgate-engine"))
    return env + api_key_env(spec.get("engine") or {})


def _container(spec: dict, image: str, port: int, tracing: TraceExport | None = None) -> dict:
    volumes_mounts = _volumes(spec)[1]
    container = {
        "name": CONTAINER,
        "image": spec.get("image") or image,
        "command": serve_command(spec, port, tracing.endpoint if tracing is not None else None),
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}]
                 + [{"name": name, "containerPort": p, "protocol": "TCP"} for name, p, _ in kv_events_ports(spec)],
        "env": engine_env(spec, tracing),
        "volumeMounts": volumes_mounts,
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "runAsNonRoot": True, "privileged": False, "capabilities": {"drop": ["ALL"]}},
        # Exec, not the `sleep` lifecycle action: that needs Kubernetes 1.30 (the e2e rig runs 1.20).
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRE_STOP_SLEEP_S)]}}},
        **_probes("http", engine_type(spec)),
    }
    if spec.get("imagePullPolicy"):
        container["imagePullPolicy"] = spec["imagePullPolicy"]
    if spec.get("resources"):
        container["resources"] = _only(spec["resources"], ("limits", "requests", "claims"))
    if requests_gpus(spec):  # one GPU a rank (an extended resource: its request is its limit)
        resources = container.setdefault("resources", {})
        resources["limits"] = {**(resources.get("limits") or {}), GPU_RESOURCE: str(tensor_parallel_size(spec))}
    return container


def _pod_spec(spec: dict, image: str, port: int, tracing: TraceExport | None = None) -> dict:
    pod = {
        "containers": [_container(spec, image, port, tracing)],
        "volumes": _volumes(spec)[0],
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "automountServiceAccountToken": False,  # engines never talk to the API server
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": termination_grace_s(spec),
    }
    if spec.get("nodeSelector"):
        pod["nodeSelector"] = dict(sorted(spec["nodeSelector"].items()))
    if spec.get("tolerations"):
        pod["tolerations"] = [_only(t, ("key", "operator", "value", "effect", "tolerationSeconds"))
                              for t in spec["tolerations"]]
    return pod


def _operator_pod_labels(ms: dict, pool: dict) -> dict[str, str]:
    """The labels the operator sets on the engine pods itself: its own, `kvgate.dev/pool` (the pool's name, for
    the metrics pipeline), the pool's selector and, for vLLM and SGLang, the engine type by which the EPP reads
    their metrics (kvgate's engine exports vLLM's names, the EPP's default)."""
    kind = engine_type(ms.get("spec") or {})
    dialect = {ENGINE_TYPE_LABEL: kind} if kind in (VLLM, SGLANG) else {}
    return {**naming.component_labels("engine", naming.engine_deployment_name(ms)), **naming.pool_label(pool),
            **dialect, **pool_labels(pool)}


def engine_pod_labels(ms: dict, pool: dict) -> dict[str, str]:
    """The engine pods' labels: `podLabels`, then the operator's (which win; tenancy.py refuses a change)."""
    return dict(sorted({**((ms.get("spec") or {}).get("podLabels") or {}), **_operator_pod_labels(ms, pool)}.items()))


def desired_engine_deployment(modelserver: dict, pool: dict | None, image: OperatorImages,
                              policy: TenantPolicy = TenantPolicy(), other_pools: list[dict] = (),
                              tracing: TraceExport | None = None) -> dict | None:
    """The engine Deployment for `modelserver`, or None when `validate_modelserver` finds problems (with
    `image`, the operator's engine image or its images per engine type, as the images that need no
    --allow-image-prefix). `tracing`: the engines export request spans there (OTEL_* env; vLLM's flag).

    The Deployment's selector is exactly the pool's selector, so every pod it makes is a pool member.
    (Kubernetes makes a Deployment's selector immutable: see `needs_recreate`.)"""
    if validate_modelserver(modelserver, pool, policy, other_pools, image):
        return None
    spec = modelserver.get("spec") or {}
    name = naming.engine_deployment_name(modelserver)
    port = pool_port(pool)
    selector = pool_labels(pool)
    pod_labels = engine_pod_labels(modelserver, pool)
    annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics",
                   **{annotation: str(p) for _, p, annotation in kv_events_ports(spec)}}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": naming.object_meta(name, modelserver, naming.component_labels("engine", name)),
        "spec": {
            "replicas": replicas_of(modelserver),
            "selector": {"matchLabels": dict(sorted(selector.items()))},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {"labels": dict(sorted(pod_labels.items())), "annotations": annotations},
                "spec": _pod_spec(spec, operator_images(image).get(engine_type(spec), ""), port, tracing),
            },
        },
    }


def needs_recreate(existing: dict | None, desired: dict | None) -> bool:
    """A Deployment's selector cannot change: when the pool's selector did, delete and create it again."""
    if not existing or not desired:
        return False
    return (existing.get("spec") or {}).get("selector") != desired["spec"]["selector"]


# --- status --------------------------------------------------------------------------------------------------

def _ready_condition(ms: dict, deployment: dict | None, problems: list[dict]) -> dict:
    gen = (ms.get("metadata") or {}).get("generation")
    if problems:
        return condition("Ready", False, problems[0]["reason"], problems[0]["message"], gen)
    if deployment is None:
        return condition("Ready", False, "DeploymentPending", "the engine Deployment does not exist yet", gen)
    want = replicas_of(ms)
    ready = int((deployment.get("status") or {}).get("readyReplicas") or 0)
    if want == 0:
        return condition("Ready", True, "ScaledToZero", "replicas is 0", gen)
    if ready >= want:
        return condition("Ready", True, "AllReplicasReady", f"{ready}/{want} replicas ready", gen)
    return condition("Ready", False, "ReplicasNotReady", f"{ready}/{want} replicas ready", gen)


def _pool_condition(ms: dict, pool: dict | None, problems: list[dict]) -> dict:
    gen = (ms.get("metadata") or {}).get("generation")
    pool_problems = [p for p in problems if p["reason"].startswith("Pool")]
    if pool_problems:
        return condition("PoolFound", False, pool_problems[0]["reason"], pool_problems[0]["message"], gen)
    return condition("PoolFound", True, "PoolFound", f"InferencePool {naming.name_of(pool)!r}", gen)


def modelserver_status(ms: dict, deployment: dict | None, pool: dict | None, now: str | None = None,
                       problems: list[dict] | None = None) -> dict:
    """ModelServer.status: counts from the Deployment, the scale subresource's selector, conditions.
    `problems`: validate_modelserver's (with the operator's policy); by default, with the default policy."""
    problems = validate_modelserver(ms, pool) if problems is None else problems
    dep_status = (deployment or {}).get("status") or {}
    status = {
        "replicas": int(dep_status.get("replicas") or 0),
        "readyReplicas": int(dep_status.get("readyReplicas") or 0),
        "conditions": stamp([_ready_condition(ms, deployment, problems), _pool_condition(ms, pool, problems)],
                            (ms.get("status") or {}).get("conditions"), now)
                      + autoscaler_conditions(ms),  # the autoscaler's own, written by it (autoscaler.py)
    }
    if pool is not None and not pool_problems(pool) and pool_labels(pool):
        status["selector"] = naming.selector_string(pool_labels(pool))
    if (ms.get("metadata") or {}).get("generation") is not None:
        status["observedGeneration"] = ms["metadata"]["generation"]
    return status


def is_ready(status: dict) -> bool:
    ready = find(status.get("conditions"), "Ready")
    return bool(ready) and ready["status"] == "True"
