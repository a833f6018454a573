"""Pure functions of the pod runner: pod spec → process, probes, restart backoff, and the pod status.

Nothing here touches the API server, the file system or processes; podrunner.py does, and calls these.
"""
from __future__ import annotations

import base64
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable

from .images import ImageTable

# Environment passed through from the runner to every container: enough to find programs and the user
# caches (the demo model, Hugging Face files), nothing that identifies the host session.
PASSTHROUGH_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "XDG_CACHE_HOME", "OMP_NUM_THREADS",
                   "VIRTUAL_ENV", "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "PYTHONPATH")

SA_TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- environment ---------------------------------------------------------------------------------------------

_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes $(VAR) expansion: known names are replaced, unknown ones kept, $$ escapes a $."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env.get(name, m.group(0))
    return _VAR_REF.sub(sub, value)


def field_ref(pod: dict, path: str, pod_ip: str, host_ip: str) -> str:
    """The downward API fields a container may read through env (valueFrom.fieldRef)."""
    md, spec = pod.get("metadata", {}), pod.get("spec", {})
    simple = {
        "metadata.name": md.get("name", ""), "metadata.namespace": md.get("namespace", ""),
        "metadata.uid": md.get("uid", ""), "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": pod_ip, "status.podIPs": pod_ip, "status.hostIP": host_ip,
    }
    if path in simple:
        return simple[path]
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m:
        return (md.get(m.group(1)) or {}).get(m.group(2), "")
    raise ValueError(f"unsupported fieldRef {path!r}")


Lookup = Callable[[str, str], dict[str, str] | None]   # (kind "ConfigMap"|"Secret", name) -> data or None


class ConfigError(Exception):
    """A reference the container needs is missing (the container's CreateContainerConfigError)."""


def _ref_value(kind: str, ref: dict, lookup: Lookup) -> str | None:
    data = lookup(kind, ref["name"])
    if data is None or ref["key"] not in data:
        if ref.get("optional"):
            return None
        raise ConfigError(f"{kind.lower()} {ref['name']!r} key {ref['key']!r} not found")
    return data[ref["key"]]


def container_env(pod: dict, container: dict, *, pod_ip: str, host_ip: str, lookup: Lookup,
                  base: dict[str, str]) -> dict[str, str]:
    """The container's environment in Kubernetes order: base, envFrom, env (later wins, $(VAR) expanded)."""
    env = dict(base)
    for src in container.get("envFrom") or []:
        for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
            if key in src:
                data = lookup(kind, src[key]["name"])
                if data is None:
                    if src[key].get("optional"):
                        continue
                    raise ConfigError(f"{kind.lower()} {src[key]['name']!r} not found")
                env.update({src.get("prefix", "") + k: v for k, v in data.items()})
    for var in container.get("env") or []:
        name = var["name"]
        if "value" in var or "valueFrom" not in var:
            env[name] = expand(var.get("value", ""), env)
            continue
        vf = var["valueFrom"]
        if "fieldRef" in vf:
            env[name] = field_ref(pod, vf["fieldRef"]["fieldPath"], pod_ip, host_ip)
        elif "configMapKeyRef" in vf:
            v = _ref_value("ConfigMap", vf["configMapKeyRef"], lookup)
            if v is not None:
                env[name] = v
        elif "secretKeyRef" in vf:
            v = _ref_value("Secret", vf["secretKeyRef"], lookup)
            if v is not None:
                env[name] = v
        elif "resourceFieldRef" in vf:
            res = vf["resourceFieldRef"]["resource"]          # e.g. limits.cpu
            kind, _, what = res.partition(".")
            env[name] = str(((container.get("resources") or {}).get(kind) or {}).get(what, "0"))
    return env


# --- paths and addresses -------------------------------------------------------------------------------------

def map_path(value: str, mounts: dict[str, str]) -> str:
    """Rewrite container paths under a mount point to the folder that holds that volume on this machine.

    Processes see the host file system, so every path under a mountPath in an argument or env value —
    `/etc/config/app.yaml`, `--config=/etc/config/app.yaml`, or inside a shell script such as
    `cat /etc/config/app.yaml > /out/x` — is pointed at the materialised volume. A path counts when it
    starts at a token boundary (not after a letter, digit, '.', '-' or '/') and the mount path ends there or
    continues with '/'. One pass, longest mount first, so a replacement is never rewritten again.
    """
    paths = sorted((m.rstrip("/") for m in mounts if m.rstrip("/")), key=len, reverse=True)
    if not paths:
        return value
    host = {m.rstrip("/"): h for m, h in mounts.items()}
    pattern = re.compile(r"(?<![\w./-])(" + "|".join(re.escape(p) for p in paths) + r")(?=/|$|[^\w.-])")
    return pattern.sub(lambda m: host[m.group(1)], value)


def bind_address(value: str, pod_ip: str) -> str:
    """Inside a pod, 0.0.0.0 means the pod's own interface; here that is its loopback IP."""
    return re.sub(r"(?<![\d.])0\.0\.0\.0(?![\d.])", pod_ip, value)


def bind_address_in_config(text: str, pod_ip: str) -> str:
    """bind_address for a config file, also turning a quoted IPv6 any-address ('::' / "::") into the pod IP,
    and 127.0.0.1 too: every pod has a loopback of its own, but here they all share the host's, so a pod's
    localhost listeners (Envoy's admin port, say) would collide across pods and across a rollout."""
    text = bind_address(text, pod_ip)
    text = re.sub(r"(?<![\d.])127\.0\.0\.1(?![\d.])", pod_ip, text)
    return re.sub(r"""(["'])::\1""", lambda m: f"{m.group(1)}{pod_ip}{m.group(1)}", text)


@dataclass(frozen=True)
class ProcessSpec:
    argv: list[str]
    env: dict[str, str]
    cwd: str


def container_process(pod: dict, container: dict, *, pod_ip: str, host_ip: str, images: ImageTable,
                      lookup: Lookup, base_env: dict[str, str], mounts: dict[str, str], workdir: str,
                      extra_env: dict[str, str] | None = None) -> ProcessSpec:
    """How to run one container: argv (from the image table), env (pod spec + downward API), cwd.

    Container-space words (the spec's env values, command, args, and the image's default args) get mount
    paths and the any-address mapped; host-space words (base_env, extra_env, the image's entrypoint) do not.
    """
    def to_host(word: str) -> str:
        return bind_address(map_path(word, mounts), pod_ip)

    spec_env = container_env(pod, container, pod_ip=pod_ip, host_ip=host_ip, lookup=lookup, base={})
    env = {**base_env, **(extra_env or {}), **{k: to_host(v) for k, v in spec_env.items()}}
    command = [expand(c, env) for c in container.get("command") or []]
    args = [expand(a, env) for a in container.get("args") or []]
    argv = images.argv(container["image"], command, args, to_host=to_host)
    # A workingDir inside a volume maps to it; any other image path does not exist here: use the pod's folder.
    wd = container.get("workingDir")
    cwd = map_path(wd, mounts) if wd else workdir
    return ProcessSpec(argv=argv, env=env, cwd=cwd if cwd != wd else workdir)


# --- volumes -------------------------------------------------------------------------------------------------

def volume_files(volume: dict, lookup_full: Callable[[str, str], dict | None], pod: dict,
                 pod_ip: str) -> dict[str, bytes] | None:
    """The files of a configMap/secret/downwardAPI volume ({relative path: bytes}); {} for emptyDir.

    None means "not ready yet" (a missing, non-optional ConfigMap or Secret). Unsupported volume types raise
    ConfigError. lookup_full(kind, name) returns the whole object (data and binaryData).
    """
    if "emptyDir" in volume:
        return {}
    for kind, key, name_key in (("ConfigMap", "configMap", "name"), ("Secret", "secret", "secretName")):
        if key in volume:
            src = volume[key]
            obj = lookup_full(kind, src[name_key])
            if obj is None:
                return {} if src.get("optional") else None
            data: dict[str, bytes] = {}
            if kind == "Secret":
                data = {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
            else:
                data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
                data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
            if src.get("items"):
                out = {}
                for item in src["items"]:
                    if item["key"] in data:
                        out[item["path"]] = data[item["key"]]
                    elif not src.get("optional"):
                        return None
                return out
            return data
    if "downwardAPI" in volume:
        out = {}
        for item in volume["downwardAPI"].get("items") or []:
            if "fieldRef" in item:
                path = item["fieldRef"]["fieldPath"]
                md = pod.get("metadata", {})
                if path in ("metadata.labels", "metadata.annotations"):
                    kv = md.get(path.split(".")[1]) or {}
                    out[item["path"]] = "\n".join(f'{k}="{v}"' for k, v in sorted(kv.items())).encode()
                else:
                    out[item["path"]] = field_ref(pod, path, pod_ip, "127.0.0.1").encode()
        return out
    kinds = [k for k in volume if k != "name"]
    raise ConfigError(f"volume {volume.get('name')!r}: type {kinds} is not supported by the pod runner")


def host_path_problem(volume: dict, is_dir: bool, exists: bool) -> str | None:
    """Why a hostPath volume cannot be mounted (the kubelet's FailedMount), given what is at its path; None when
    it can. Types as the kubelet checks them: Directory and File must exist as such, "" (the default) takes
    anything; the creating types (DirectoryOrCreate, FileOrCreate) and the device/socket types are not provided."""
    source = volume["hostPath"]
    kind = source.get("type") or ""
    if kind == "Directory" and not is_dir:
        return f"volume {volume['name']!r}: hostPath {source['path']!r} is not a directory"
    if kind == "File" and (is_dir or not exists):
        return f"volume {volume['name']!r}: hostPath {source['path']!r} is not a file"
    if kind not in ("", "Directory", "File"):
        return f"volume {volume['name']!r}: hostPath type {kind!r} is not supported by the pod runner"
    return None


# --- probes --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ProbeCheck:
    kind: str                           # "http" | "tcp" | "exec"
    host: str = ""
    port: int = 0
    path: str = "/"
    scheme: str = "HTTP"
    headers: tuple[tuple[str, str], ...] = ()
    command: tuple[str, ...] = ()
    timeout_s: float = 1.0


def resolve_port(port: Any, container: dict) -> int:
    if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"named port {port!r} is not declared by container {container.get('name')!r}")


def probe_check(probe: dict, container: dict, pod_ip: str) -> ProbeCheck:
    """What a probe asks for, as a pure value (the runner performs it)."""
    timeout = float(probe.get("timeoutSeconds", 1))
    if "httpGet" in probe:
        h = probe["httpGet"]
        return ProbeCheck("http", host=h.get("host") or pod_ip, port=resolve_port(h["port"], container),
                          path=h.get("path") or "/", scheme=(h.get("scheme") or "HTTP").upper(),
                          headers=tuple((x["name"], x["value"]) for x in h.get("httpHeaders") or []),
                          timeout_s=timeout)
    if "tcpSocket" in probe:
        t = probe["tcpSocket"]
        return ProbeCheck("tcp", host=t.get("host") or pod_ip, port=resolve_port(t["port"], container),
                          timeout_s=timeout)
    if "exec" in probe:
        return ProbeCheck("exec", command=tuple(probe["exec"].get("command") or ()), timeout_s=timeout)
    raise ValueError(f"unsupported probe {sorted(probe)} (Kubernetes 1.20 has httpGet, tcpSocket, exec)")


@dataclass
class ProbeState:
    """Kubelet's probe worker state for one probe of one container run."""
    result: bool                 # the current verdict (readiness starts False, liveness True)
    successes: int = 0
    failures: int = 0
    last_run: float | None = None


def probe_initial(kind: str) -> ProbeState:
    return ProbeState(result=(kind == "liveness"))


def probe_due(state: ProbeState, probe: dict, started_at: float, now: float) -> bool:
    if now < started_at + float(probe.get("initialDelaySeconds", 0)):
        return False
    return state.last_run is None or now >= state.last_run + float(probe.get("periodSeconds", 10))


def probe_record(state: ProbeState, probe: dict, ok: bool, now: float) -> ProbeState:
    """Apply one probe outcome with successThreshold/failureThreshold, as the kubelet does."""
    succ = state.successes + 1 if ok else 0
    fail = 0 if ok else state.failures + 1
    result = state.result
    if ok and succ >= int(probe.get("successThreshold", 1)):
        result = True
    if not ok and fail >= int(probe.get("failureThreshold", 3)):
        result = False
    return ProbeState(result=result, successes=succ, failures=fail, last_run=now)


def crash_backoff_s(restarts: int, base_s: float, cap_s: float) -> float:
    """Kubelet's CrashLoopBackOff: base, 2*base, 4*base, ... capped."""
    return min(cap_s, base_s * (2 ** max(0, restarts - 1))) if restarts > 0 else 0.0


def should_restart(policy: str, exit_code: int) -> bool:
    return policy == "Always" or (policy == "OnFailure" and exit_code != 0)


# --- status --------------------------------------------------------------------------------------------------

@dataclass
class ContainerRun:
    """What the runner knows about one container (the runtime side of a containerStatus)."""
    name: str
    image: str
    state: str = "waiting"              # waiting | running | terminated
    reason: str = "ContainerCreating"
    message: str = ""
    exit_code: int | None = None
    started_at: float | None = None
    finished_at: float | None = None
    restart_count: int = 0
    ready: bool = False
    pid: int | None = None
    last_terminated: dict | None = None  # lastState.terminated of the previous run
    extra: dict = field(default_factory=dict)


def container_status(c: ContainerRun) -> dict:
    if c.state == "running":
        state = {"running": {"startedAt": rfc3339(c.started_at or 0)}}
    elif c.state == "terminated":
        state = {"terminated": {"exitCode": c.exit_code if c.exit_code is not None else -1,
                                "reason": c.reason or ("Completed" if c.exit_code == 0 else "Error"),
                                "startedAt": rfc3339(c.started_at or 0),
                                "finishedAt": rfc3339(c.finished_at or 0)}}
        if c.message:
            state["terminated"]["message"] = c.message
    else:
        state = {"waiting": {"reason": c.reason}}
        if c.message:
            state["waiting"]["message"] = c.message
    out = {"name": c.name, "image": c.image, "imageID": f"k8srig://{c.image}", "state": state,
           "lastState": {"terminated": c.last_terminated} if c.last_terminated else {},
           "ready": c.ready, "restartCount": c.restart_count, "started": c.state == "running"}
    if c.pid:
        out["containerID"] = f"k8srig://{c.pid}"
    return out


def pod_phase(runs: list[ContainerRun], restart_policy: str) -> str:
    if not runs or any(r.state == "waiting" and r.started_at is None and r.restart_count == 0 for r in runs):
        return "Pending"
    if any(r.state in ("running", "waiting") for r in runs):
        return "Running"
    # Every container has terminated for good (the runner only leaves a container terminated when its
    # restartPolicy does not bring it back).
    return "Succeeded" if all(r.exit_code == 0 for r in runs) else "Failed"


def _condition(kind: str, ok: bool, previous: dict[str, dict], now: float, reason: str = "") -> dict:
    status = "True" if ok else "False"
    prev = previous.get(kind)
    ltt = prev["lastTransitionTime"] if prev and prev.get("status") == status and prev.get("lastTransitionTime") \
        else rfc3339(now)
    cond = {"type": kind, "status": status, "lastTransitionTime": ltt}
    if not ok and reason:
        cond["reason"] = reason
    return cond


def pod_status(pod: dict, runs: list[ContainerRun], *, pod_ip: str, host_ip: str, start_time: float,
               now: float, previous: dict | None = None, init_runs: list[ContainerRun] | None = None) -> dict:
    """The status the runner writes for a pod (phase, IPs, conditions, container statuses).

    `previous` is the status the runner wrote last (conditions keep their lastTransitionTime while unchanged).
    `init_runs` are the init containers: until all have exited 0 the pod is Pending (Failed if one failed for
    good) and not Initialized.
    """
    previous = {c["type"]: c for c in (previous or {}).get("conditions") or []}
    policy = pod.get("spec", {}).get("restartPolicy", "Always")
    init_runs = init_runs or []
    initialized = all(r.state == "terminated" and r.exit_code == 0 for r in init_runs)
    init_failed = any(r.state == "terminated" and r.exit_code != 0 for r in init_runs)
    phase = "Failed" if init_failed else pod_phase(runs, policy) if initialized else "Pending"
    all_ready = initialized and bool(runs) and all(r.ready for r in runs)
    status = {
        "phase": phase,
        "hostIP": host_ip,
        "podIP": pod_ip,
        "podIPs": [{"ip": pod_ip}],
        "startTime": rfc3339(start_time),
        "conditions": [
            _condition("Initialized", initialized, previous, now, "ContainersNotInitialized"),
            _condition("Ready", all_ready and phase == "Running", previous, now, "ContainersNotReady"),
            _condition("ContainersReady", all_ready and phase == "Running", previous, now, "ContainersNotReady"),
            _condition("PodScheduled", True, previous, now),
        ],
        "containerStatuses": [container_status(r) for r in runs],
    }
    if init_runs:
        status["initContainerStatuses"] = [container_status(r) for r in init_runs]
    return status


def status_changed(old: dict | None, new: dict) -> bool:
    """Whether a freshly built status differs from what the API server holds (ignoring server-owned keys)."""
    if old is None:
        return True
    keys = ("phase", "podIP", "hostIP", "conditions", "containerStatuses", "initContainerStatuses")
    return any(old.get(k) != new.get(k) for k in keys)
