"""ModelServer → a Deployment of `kvgate serve` pods that are members of the ModelServer's InferencePool.

The pods carry the pool's selector labels and serve on the pool's first target port, so the pool (and its
EPP) picks them up with no further wiring. The root filesystem is read-only: the engine writes only to its
cache dir (the demo model, compiled kernels) and /tmp, both emptyDirs.

Security: the pods run as the image's own non-root user (uid 10001, the Dockerfile's USER; set explicitly so
that an allowed override image whose USER is root cannot run as root), with no privilege escalation, every
capability dropped, the RuntimeDefault seccomp profile and no service-account token; what a tenant may add
(host mounts, other images, labels) is ruled by tenancy.py.

Drain (a rolling update or scale-down): the kubelet runs the preStop hook (a short sleep) first, while the pod
still serves: by then its deletion has reached the EPP's pod watch (and the Gateways' FailOpen fallback
lists), so no new request is routed to it when the engine gets SIGTERM. The engine then turns /health 503,
admits nothing new and finishes its streams within `--shutdown-timeout` (vLLM's flag; spec.engine.
shutdownGracePeriodSeconds); terminationGracePeriodSeconds covers the sleep, that grace and a margin to exit.
Liveness is /live: 200 while the model loads and while it drains, 503 only once the engine loop died (and by
default the server then exits, so the container restarts at once); the kubelet also stops liveness probes once
a pod is being deleted, so a draining engine is never restarted.
"""

from __future__ import annotations

import json
import re

from kvgate.common.epp_protocol import KV_EVENTS_PORT_ANNOTATION, KV_EVENTS_REPLAY_PORT_ANNOTATION
from kvgate.operator import naming
from kvgate.operator.conditions import condition, find, stamp
from kvgate.operator.spec_shape import modelserver_problems, pool_problems, pool_ref_name
from kvgate.operator.tenancy import TenantPolicy, escalation_problems, label_problems

CACHE_DIR = "/var/cache/kvgate"
CONTAINER = "engine"
DEFAULT_MODEL = "demo"
RUN_AS = 10001  # the kvgate image's USER (Dockerfile): files the image gives its user stay readable
DEFAULT_SHUTDOWN_GRACE_S = 30  # the engine's --shutdown-timeout unless spec.engine says otherwise
# preStop sleep before SIGTERM: a pod watch event reaches the EPP in well under a second, an operator-rendered
# FailOpen fallback list within a reconcile; 5 s covers both with room, and is short against the drain grace.
PRE_STOP_SLEEP_S = 5
EXIT_MARGIN_S = 5  # after the drain grace, for the process to exit before the kubelet's SIGKILL
# Flags the operator sets itself; extraArgs may not set them again (argparse's last one would win).
OPERATOR_FLAGS = ("--host", "--port", "--shutdown-timeout")
# Flags with a spec field that the pod's shape depends on (GPUs requested, /dev/shm): set through the field only.
SPEC_FLAGS = {"--tensor-parallel-size": "engine.tensorParallelSize", "--quantization": "engine.quantization"}
QUANTIZATIONS = ("fp8", "compressed-tensors", "gptq", "awq")  # vLLM's --quantization values the engine loads
GPU_RESOURCE = "nvidia.com/gpu"
# A memory-backed /dev/shm for tensor-parallel ranks (torch.distributed's transfers between the ranks' processes
# use shared memory; the container runtime's default /dev/shm is 64Mi). It counts against the pod's memory.
SHM_SIZE = "1Gi"
API_KEY_ENV = "VLLM_API_KEY"  # what `kvgate serve` reads (engine/server/auth.py), as vLLM does
# spec.engine.apiKeySecretRef: a Secret's name (a DNS subdomain) and one of its keys, as the API server checks them
_SECRET_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_SECRET_KEY = re.compile(r"\.?[-_a-zA-Z0-9][-._a-zA-Z0-9]*")  # not "." nor ".." nor "..x"

_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti)?$")


def kv_cache_bytes(quantity: int | str) -> int:
    """`kvCacheMemory` (bytes, or a binary-suffixed quantity such as "2Gi") as bytes."""
    if isinstance(quantity, int):
        return quantity
    m = _QUANTITY.match(str(quantity).strip())
    if not m:
        raise ValueError(f"not a byte quantity: {quantity!r} (e.g. 2147483648 or 2Gi)")
    power = ["", "Ki", "Mi", "Gi", "Ti"].index(m.group(2) or "")
    return int(float(m.group(1)) * 1024 ** power)


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
        taken = sorted(flags & set(OPERATOR_FLAGS))
        spec_owned = sorted(f"{flag} (set {field})" for flag, field in SPEC_FLAGS.items()
                            if any(len(f) > 2 and flag.startswith(f) for f in flags))
        if spec_owned:
            problems.append({"reason": "InvalidSpec",
                             "message": f"extraArgs may not set {', '.join(spec_owned)}: the pod's resources and "
                                        "volumes follow those fields"})
        if taken:
            problems.append({"reason": "InvalidSpec",
                             "message": f"extraArgs may not set {', '.join(taken)}: the operator sets them (the "
                                        "pool's port; spec.engine.shutdownGracePeriodSeconds)"})
        # argparse takes any unambiguous prefix of a flag, so `--api` is `--api-key` too.
        if any(len(f) > 2 and "--api-key".startswith(f) for f in flags):
            problems.append({"reason": "InvalidSpec",
                             "message": "extraArgs may not set --api-key: a key there is readable by anyone who "
                                        "can read the ModelServer, its Deployment or its pods; put it in a Secret "
                                        "and name it in spec.engine.apiKeySecretRef"})
    problems += _api_key_ref_problems(spec)
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
ADAPTERS_DIR = "/adapters"  # where spec.engine.lora.source is mounted (read-only)


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


def lora_flags(lora: dict) -> list[str]:
    """spec.engine.lora as vLLM's flags, each adapter a --lora-modules name=/adapters/<path>."""
    flags = ["--enable-lora"]
    for field, flag in (("maxLoras", "--max-loras"), ("maxLoraRank", "--max-lora-rank"),
                        ("maxCpuLoras", "--max-cpu-loras")):
        if lora.get(field) is not None:
            flags += [flag, str(lora[field])]
    return flags + ["--lora-modules", *(f"{a['name']}={ADAPTERS_DIR}/{a['path'].strip('/')}" for a in lora["adapters"])]


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


def validate_modelserver(ms: dict, pool: dict | None, policy: TenantPolicy = TenantPolicy(),
                         other_pools: list[dict] = (), operator_image: str | None = None) -> list[dict]:
    """Problems ({reason, message}) the schema cannot catch; empty when a Deployment can be made.

    Some of these the CRD's CEL rules also reject — they are checked again for clusters too old to run CEL
    (the e2e rig is Kubernetes 1.20). `policy`, `other_pools` (the namespace's other InferencePools) and
    `operator_image` (the engine image the operator runs by default) feed tenancy.py's rules."""
    shape = modelserver_problems(ms)
    if shape:  # nothing else can be judged (or rendered) from a spec of the wrong shape
        return [{"reason": "InvalidSpec", "message": "; ".join(shape)}] + _pool_problems(ms, pool)
    problems = (_pool_problems(ms, pool) + _spec_problems(ms) + _kv_events_problems(ms, pool) + _lora_problems(ms)
                + escalation_problems(ms, policy, operator_image))
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
    """spec.replicas; 1 when unset or null (the CRD's default)."""
    replicas = (ms.get("spec") or {}).get("replicas")
    return 1 if replicas is None else int(replicas)


def engine_flags(engine: dict) -> list[str]:
    """`spec.engine` as `kvgate serve` flags, in a fixed order; unset fields keep the engine's defaults."""
    valued = [("backend", "--backend"), ("device", "--device"), ("dtype", "--dtype"),
              ("blockSize", "--block-size"), ("maxNumSeqs", "--max-num-seqs"),
              ("maxNumBatchedTokens", "--max-num-batched-tokens"), ("maxModelLen", "--max-model-len")]
    flags = []
    for field, flag in valued:
        if engine.get(field) is not None:
            flags += [flag, str(engine[field])]
    if engine.get("kvCacheMemory") is not None:
        flags += ["--kv-cache-memory", str(kv_cache_bytes(engine["kvCacheMemory"]))]
    if engine.get("gpuMemoryUtilization") is not None:
        flags += ["--gpu-memory-utilization", repr(float(engine["gpuMemoryUtilization"]))]
    if engine.get("kvCacheDtype") is not None:
        flags += ["--kv-cache-dtype", engine["kvCacheDtype"]]
    if engine.get("quantization") is not None:
        flags += ["--quantization", engine["quantization"]]
    if engine.get("tensorParallelSize") is not None:
        flags += ["--tensor-parallel-size", str(int(engine["tensorParallelSize"]))]
    if engine.get("speculativeConfig"):
        flags += ["--speculative-config", json.dumps(speculative_config(engine["speculativeConfig"]),
                                                      separators=(",", ":"))]
    if engine.get("enablePrefixCaching") is not None:
        flags.append("--enable-prefix-caching" if engine["enablePrefixCaching"] else "--no-enable-prefix-caching")
    if engine.get("kvEvents"):
        flags += ["--kv-events-config", json.dumps(kv_events_config(engine["kvEvents"]), separators=(",", ":"))]
    if engine.get("lora"):
        flags += lora_flags(engine["lora"])
    if engine.get("apiKeySecretRef"):
        # The key itself comes in the environment (api_key_env); this makes an empty Secret value a failed start
        # rather than an engine that serves without a key.
        flags.append("--require-api-key")
    return flags


def api_key_env(engine: dict) -> list[dict]:
    """VLLM_API_KEY from spec.engine.apiKeySecretRef: a reference the kubelet resolves in the pod's own namespace
    (the ModelServer's), so the key is in no object the operator writes, and the operator never reads it. Not
    optional: without the Secret or its key the container does not start (CreateContainerConfigError)."""
    ref = engine.get("apiKeySecretRef")
    if not ref:
        return []
    return [{"name": API_KEY_ENV,
             "valueFrom": {"secretKeyRef": {"name": ref["name"], "key": ref["key"], "optional": False}}}]


def speculative_config(spec: dict) -> dict:
    """spec.engine.speculativeConfig as vLLM's --speculative-config JSON (prompt lookup; unset keys keep the engine's
    defaults)."""
    config = {"method": spec.get("method") or "ngram", "num_speculative_tokens": spec["numSpeculativeTokens"]}
    for field, key in (("promptLookupMin", "prompt_lookup_min"), ("promptLookupMax", "prompt_lookup_max")):
        if spec.get(field) is not None:
            config[key] = spec[field]
    return config


def kv_events_config(kv_events: dict) -> dict:
    """spec.engine.kvEvents as vLLM's --kv-events-config JSON: bind every interface of the pod (the EPP connects
    from its own pod) on the given ports. The events carry prompts' token ids and cache salts: the pool's
    `<pool>-engines` NetworkPolicy (network_policy.py) admits only its EPP to these ports. The publisher's byte
    and replay limits keep the engine's defaults (engine/kv_events.py)."""
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{int(kv_events['port'])}"}
    if kv_events.get("replayPort"):
        config["replay_endpoint"] = f"tcp://*:{int(kv_events['replayPort'])}"
    return config


def kv_events_ports(spec: dict) -> list[tuple[str, int, str]]:
    """(port name, port, pod annotation) for each KV-event socket spec.engine.kvEvents opens."""
    kv_events = (spec.get("engine") or {}).get("kvEvents") or {}
    named = [("kv-events", kv_events.get("port"), KV_EVENTS_PORT_ANNOTATION),
             ("kv-replay", kv_events.get("replayPort"), KV_EVENTS_REPLAY_PORT_ANNOTATION)]
    return [(name, int(port), annotation) for name, port, annotation in named if port]


def shutdown_grace_s(spec: dict) -> int:
    value = (spec.get("engine") or {}).get("shutdownGracePeriodSeconds")
    return DEFAULT_SHUTDOWN_GRACE_S if value is None else int(value)


def termination_grace_s(spec: dict) -> int:
    """The pod's terminationGracePeriodSeconds: the preStop sleep, the engine's drain grace, a margin to exit."""
    return PRE_STOP_SLEEP_S + shutdown_grace_s(spec) + EXIT_MARGIN_S


def serve_command(spec: dict, port: int) -> list[str]:
    model = spec.get("model") or {}
    path = model.get("path") or DEFAULT_MODEL
    command = ["kvgate", "serve", path, "--host", "0.0.0.0", "--port", str(port),
               "--served-model-name", model.get("servedModelName") or path]
    return (command + engine_flags(spec.get("engine") or {})
            + ["--shutdown-timeout", str(shutdown_grace_s(spec))]
            + [str(a) for a in spec.get("extraArgs") or []])


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


def _probes(port_name: str) -> dict:
    # Startup and readiness are GET /health: 503 until the model is loaded, 200 while the engine serves, 503
    # once the engine loop died or a drain began. Liveness is GET /live, 503 only once the loop died. The startup
    # probe holds liveness off during a model load (up to STARTUP_LIMIT_S), probed every second so a new replica is
    # checked for readiness as soon as it is up.
    # Readiness every second (a /health answer costs microseconds): a replica joins the pool as soon as it is
    # up (tests/e2e/test_operator_e2e.py prints the scale-up time) and leaves it within ~3 s of turning 503.
    # Liveness restarts a container whose engine loop died (and which was told to stay up) within ~30 s (6
    # failures, 5 s apart) and tolerates /live being slow for ~25 s (a slow step starving the server). No gRPC
    # probes: the e2e rig runs Kubernetes 1.20.
    health = {"httpGet": {"path": "/health", "port": port_name}}
    return {
        "startupProbe": {**health, "periodSeconds": 1, "timeoutSeconds": 2, "failureThreshold": STARTUP_LIMIT_S},
        "readinessProbe": {**health, "periodSeconds": 1, "timeoutSeconds": 2, "failureThreshold": 3},
        "livenessProbe": {"httpGet": {"path": "/live", "port": port_name}, "periodSeconds": 5, "timeoutSeconds": 5,
                          "failureThreshold": 6},
    }


def _only(mapping: dict, keys: tuple[str, ...]) -> dict:
    """The named fields of a user-supplied structure: the pod spec never carries a field the operator did not
    choose to pass (the API server prunes unknown fields too; this holds where a schema is looser)."""
    return {k: mapping[k] for k in keys if k in mapping}


def _container(spec: dict, image: str, port: int) -> dict:
    volumes_mounts = _volumes(spec)[1]
    container = {
        "name": CONTAINER,
        "image": spec.get("image") or image,
        "command": serve_command(spec, port),
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}]
                 + [{"name": name, "containerPort": p, "protocol": "TCP"} for name, p, _ in kv_events_ports(spec)],
        "env": [{"name": "KVGATE_CACHE_DIR", "value": CACHE_DIR}, {"name": "HOME", "value": "/tmp"},
                {"name": "PYTHONUNBUFFERED", "value": "1"}, *api_key_env(spec.get("engine") or {})],
        "volumeMounts": volumes_mounts,
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "runAsNonRoot": True, "privileged": False, "capabilities": {"drop": ["ALL"]}},
        # Exec, not the `sleep` lifecycle action: that needs Kubernetes 1.30 (the e2e rig runs 1.20).
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRE_STOP_SLEEP_S)]}}},
        **_probes("http"),
    }
    if spec.get("imagePullPolicy"):
        container["imagePullPolicy"] = spec["imagePullPolicy"]
    if spec.get("resources"):
        container["resources"] = _only(spec["resources"], ("limits", "requests", "claims"))
    if requests_gpus(spec):  # one GPU a rank (an extended resource: its request is its limit)
        resources = container.setdefault("resources", {})
        resources["limits"] = {**(resources.get("limits") or {}), GPU_RESOURCE: str(tensor_parallel_size(spec))}
    return container


def _pod_spec(spec: dict, image: str, port: int) -> dict:
    pod = {
        "containers": [_container(spec, image, port)],
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
    """The labels the operator sets on the engine pods itself: its own and the pool's selector."""
    return {**naming.component_labels("engine", naming.engine_deployment_name(ms)), **pool_labels(pool)}


def engine_pod_labels(ms: dict, pool: dict) -> dict[str, str]:
    """The engine pods' labels: `podLabels`, then the operator's (which win; tenancy.py refuses a change)."""
    return dict(sorted({**((ms.get("spec") or {}).get("podLabels") or {}), **_operator_pod_labels(ms, pool)}.items()))


def desired_engine_deployment(modelserver: dict, pool: dict | None, image: str,
                              policy: TenantPolicy = TenantPolicy(), other_pools: list[dict] = ()) -> dict | None:
    """The engine Deployment for `modelserver`, or None when `validate_modelserver` finds problems (with
    `image`, the operator's engine image, as the one image that needs no --allow-image-prefix).

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
                "spec": _pod_spec(spec, image, port),
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
                            (ms.get("status") or {}).get("conditions"), now),
    }
    if pool is not None and not pool_problems(pool) and pool_labels(pool):
        status["selector"] = naming.selector_string(pool_labels(pool))
    if (ms.get("metadata") or {}).get("generation") is not None:
        status["observedGeneration"] = ms["metadata"]["generation"]
    return status


def is_ready(status: dict) -> bool:
    ready = find(status.get("conditions"), "Ready")
    return bool(ready) and ready["status"] == "True"
