"""The rig's kubelet: one Node on this machine whose pods run as local processes on their own loopback IPs.

    python -m k8srig.podrunner --kubeconfig KC --run-dir DIR [--node-name N] [--pod-network 127.1]

It registers the Node and keeps its status and Lease fresh; binds pending pods to it (the scheduler's job; a
binding the API server refuses is tried again), watching every pod and listing them anew every 30 s;
and for each pod bound to it runs a worker that materialises ConfigMap/Secret/emptyDir/downwardAPI volumes
(refreshed when they change, with the kubelet's ..data symlink swap), starts each container as a process
group (see images.py for which program stands in for which image), runs readiness/liveness/startup probes,
restarts containers per restartPolicy with CrashLoopBackOff, patches the pod status, and on deletion runs the
containers' preStop exec hooks, stops the processes (SIGTERM, the rest of the grace period, SIGKILL) and
completes the deletion. SIGTERM stops every container it started and exits. With --network-policy-nft it is
also the node's CNI policy agent: each pod runs in a cgroup of its own and NetworkPolicy ingress rules are
enforced with nftables (podnet.py, netpol.py).

Every process group it starts is recorded as a file under RUN_DIR/pgids/ until it is gone, so whoever started
the runner can stop what is left, by process group id, even if the runner itself was killed.
"""
from __future__ import annotations

import argparse
import base64
import http.client
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path

from . import netpol, podnet
from . import podspec as ps
from . import procs, vllm_venv
from .images import ImageNotRunnable, ImageTable, Programs, config_arg
from .controlplane import SERVICE_BLOCK
from .kube import CORE, LEASE, ApiError, Client, Kubeconfig
from .serviceproxy import ServiceProxy

log = logging.getLogger("k8srig.podrunner")

TICK_S = 0.2                 # worker loop period (probe timing resolution)
VOLUME_REFRESH_S = 1.0       # how often referenced ConfigMaps/Secrets are re-read
HEARTBEAT_S = 5.0            # node lease renewal and status heartbeat
RELIST_S = 30.0              # the pod watch lists every pod anew this often: a missed event or a crashed worker
                             # strands no pod for long (a watch lasts 30 s: at most ~60 s)
FINISHED_MEMORY_S = 600.0    # how long the runner remembers a pod UID it ran to its end (late events ignored)
BIND_RETRY_S = 1.0           # a binding the API server refused is tried again this often (the scheduler's backoff)
STOP_GRACE_CAP_S = 30.0      # upper bound on any pod's termination grace period here
PRE_STOP_MIN_TERM_S = 2.0    # the kubelet's extra grace for SIGTERM after preStop used up the period
HOST_IP = "127.0.0.1"


def microtime(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int((t % 1) * 1e6):06d}Z"


# --- processes -----------------------------------------------------------------------------------------------

class ProcessGroups:
    """Container processes, each the leader of its own process group, with a file per live group under DIR."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)

    def start(self, argv: list[str], *, env: dict[str, str], cwd: str, log_path: Path) -> subprocess.Popen:
        proc = procs.start_group(argv, env=env, cwd=cwd, log_path=log_path)
        (self.dir / str(proc.pid)).write_text(" ".join(argv))
        return proc

    def stop(self, proc: subprocess.Popen, grace_s: float) -> int | None:
        code = procs.stop_group(proc, grace_s)
        self.forget(proc)
        return code

    def forget(self, proc: subprocess.Popen) -> None:
        """After the leader exited: kill what is left of its group and drop the record."""
        if proc.poll() is not None:
            procs.kill_group(proc.pid, signal.SIGKILL)
            (self.dir / str(proc.pid)).unlink(missing_ok=True)


# --- volumes -------------------------------------------------------------------------------------------------

def write_atomic_volume(directory: Path, files: dict[str, bytes]) -> bool:
    """Write files the way the kubelet does: a timestamped folder, a `..data` symlink swapped atomically,
    and per-entry symlinks through `..data`. Returns whether anything changed."""
    directory.mkdir(parents=True, exist_ok=True)
    data_link = directory / "..data"
    if data_link.is_symlink():
        current = data_link.resolve()
        existing = {str(p.relative_to(current)): p.read_bytes() for p in current.rglob("*") if p.is_file()}
        if existing == files:
            return False
    stamp = directory / f"..{time.strftime('%Y_%m_%d_%H_%M_%S')}.{time.monotonic_ns()}"
    stamp.mkdir()
    for rel, content in files.items():
        target = stamp / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
    old = data_link.resolve() if data_link.is_symlink() else None
    tmp = directory / "..data_tmp"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(stamp.name)
    os.replace(tmp, data_link)
    tops = {rel.split("/", 1)[0] for rel in files}
    for top in tops:
        link = directory / top
        if not link.is_symlink():
            link.symlink_to(f"..data/{top}")
    for entry in directory.iterdir():
        if entry.is_symlink() and not entry.name.startswith("..") and entry.name not in tops:
            entry.unlink()
    if old is not None and old != stamp.resolve():
        shutil.rmtree(old, ignore_errors=True)
    return True


# --- probes --------------------------------------------------------------------------------------------------

def run_probe(check: ps.ProbeCheck, env: dict[str, str], cwd: str, wrap=lambda argv: argv) -> bool:
    try:
        if check.kind == "tcp":
            with socket.create_connection((check.host, check.port), timeout=check.timeout_s):
                return True
        if check.kind == "http":
            if check.scheme == "HTTPS":
                conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                    check.host, check.port, timeout=check.timeout_s, context=ssl._create_unverified_context())
            else:
                conn = http.client.HTTPConnection(check.host, check.port, timeout=check.timeout_s)
            try:
                conn.request("GET", check.path, headers={"User-Agent": "kube-probe/1.20", **dict(check.headers)})
                return 200 <= conn.getresponse().status < 400
            finally:
                conn.close()
        if check.kind == "exec":
            r = subprocess.run(wrap(list(check.command)), env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=check.timeout_s)
            return r.returncode == 0
    except (OSError, subprocess.TimeoutExpired, http.client.HTTPException):
        return False
    return False


# --- one pod -------------------------------------------------------------------------------------------------

class ContainerSlot:
    """A container of a running pod: its status record, its current process and probe states."""

    def __init__(self, spec: dict, init: bool = False, waiting_reason: str = "ContainerCreating"):
        self.spec = spec
        self.init = init                 # an init container: runs to completion before the others start
        self.run = ps.ContainerRun(name=spec["name"], image=spec["image"], reason=waiting_reason)
        self.proc: subprocess.Popen | None = None
        self.next_start = 0.0
        self.spec_env: dict[str, str] = {}
        self.cwd = "/"
        self.probes: dict[str, ps.ProbeState] = {}
        self.started_ok = False          # the startup probe has passed (or there is none)


class PodWorker(threading.Thread):
    def __init__(self, runner: "Runner", pod: dict):
        md = pod["metadata"]
        super().__init__(name=f"pod-{md['namespace']}/{md['name']}", daemon=True)
        self.runner, self.key, self.uid = runner, (md["namespace"], md["name"]), md["uid"]
        self.lock = threading.Lock()
        self.pod = pod
        self.gone = False                   # the API object no longer exists
        self.completed = False              # ran to the pod's end (deleted, or gone): never to be run again here
        self.ip = runner.allocate_ip()
        self.dir = runner.run_dir / "pods" / f"{md['namespace']}_{md['name']}_{md['uid'][:8]}"
        self.init_slots = [ContainerSlot(c, init=True) for c in pod["spec"].get("initContainers") or []]
        first = "PodInitializing" if self.init_slots else "ContainerCreating"
        self.slots = [ContainerSlot(c, waiting_reason=first) for c in pod["spec"]["containers"]]
        self.start_time = time.time()
        self.last_status: dict | None = None
        self.mounts_ready = False
        self.volume_error = ""
        self.next_volume_refresh = 0.0
        self.volume_dirs: dict[str, Path] = {}
        self.cgroup: Path | None = None     # with NetworkPolicy enforced: the pod's own cgroup

    def update(self, pod: dict) -> None:
        labels_changed = False
        with self.lock:
            if pod["metadata"]["uid"] == self.uid:
                labels_changed = (pod["metadata"].get("labels") != self.pod["metadata"].get("labels"))
                self.pod = pod
        if self.runner.policy is not None and labels_changed:
            self.runner.policy.wake()

    def in_pod(self, argv: list[str]) -> list[str]:
        """argv as a process of this pod: inside its cgroup, where NetworkPolicy knows it by."""
        return podnet.PodCgroups.wrap(argv, self.cgroup) if self.cgroup is not None else argv

    def policy_info(self) -> netpol.PodInfo | None:
        # No cgroup (yet, or any more): nothing of the pod's to isolate, and nft refuses a rule naming a missing one.
        if self.cgroup is None or not self.cgroup.is_dir():
            return None
        with self.lock:
            md, spec = self.pod["metadata"], self.pod["spec"]
        named = {p["name"]: ((p.get("protocol") or "TCP").upper(), int(p["containerPort"]))
                 for c in spec.get("containers") or [] for p in c.get("ports") or [] if p.get("name")}
        return netpol.PodInfo(namespace=self.key[0], name=self.key[1], ip=self.ip,
                              cgroup=self.runner.cgroups.nft_path(self.cgroup), labels=dict(md.get("labels") or {}),
                              named_ports=named)

    def mark_gone(self) -> None:
        with self.lock:
            self.gone = True

    # lookups for env and volumes ------------------------------------------------------------------------
    def _lookup_full(self, kind: str, name: str) -> dict | None:
        return self.runner.client.get_or_none(CORE[kind], name, self.key[0])

    def _lookup_data(self, kind: str, name: str) -> dict[str, str] | None:
        obj = self._lookup_full(kind, name)
        if obj is None:
            return None
        if kind == "Secret":
            return {k: base64.b64decode(v).decode(errors="replace") for k, v in (obj.get("data") or {}).items()}
        return dict(obj.get("data") or {})

    def refresh_volumes(self, pod: dict) -> None:
        errors = []
        ready = True
        for vol in pod["spec"].get("volumes") or []:
            if "hostPath" in vol:  # the node's own folder, mounted where it is (processes see the host's files)
                self.volume_dirs[vol["name"]] = Path(vol["hostPath"]["path"])
                problem = ps.host_path_problem(vol, Path(vol["hostPath"]["path"]).is_dir(),
                                               Path(vol["hostPath"]["path"]).exists())
                if problem:
                    errors.append(problem)
                    ready = False
                continue
            vdir = self.dir / "volumes" / vol["name"]
            self.volume_dirs[vol["name"]] = vdir
            try:
                files = ps.volume_files(vol, self._lookup_full, pod, self.ip)
            except ps.ConfigError as e:
                errors.append(str(e))
                ready = False
                continue
            except (ApiError, OSError) as e:  # the API server unreachable too: keep what is mounted
                errors.append(str(e))
                ready = ready and self.mounts_ready
                continue
            if files is None:
                errors.append(f"volume {vol['name']!r}: its ConfigMap/Secret does not exist")
                ready = ready and self.mounts_ready
                continue
            if "emptyDir" in vol:
                vdir.mkdir(parents=True, exist_ok=True)
            elif write_atomic_volume(vdir, files) and self.mounts_ready:
                log.info("%s/%s: volume %s updated", *self.key, vol["name"])
        self.mounts_ready, self.volume_error = ready, "; ".join(errors)

    def mounts_for(self, container: dict) -> dict[str, str]:
        out = {}
        for m in container.get("volumeMounts") or []:
            vdir = self.volume_dirs.get(m["name"])
            if vdir is not None:
                out[m["mountPath"]] = str(vdir / m["subPath"]) if m.get("subPath") else str(vdir)
        return out

    def pod_kubeconfig(self, container: dict) -> str | None:
        """A kubeconfig carrying the pod's service-account token (in-cluster clients read KUBECONFIG here)."""
        token_dir = self.mounts_for(container).get(ps.SA_TOKEN_DIR)
        if not token_dir or not (Path(token_dir) / "token").exists():
            return None
        path = self.dir / "kubeconfig"
        cfg = self.runner.client.config
        kc = Kubeconfig(server=cfg.server, ca_pem=cfg.ca_pem, token=(Path(token_dir) / "token").read_text())
        path.write_text(kc.to_yaml("in-cluster"))
        return str(path)

    # containers ----------------------------------------------------------------------------------------
    def start_container(self, slot: ContainerSlot, pod: dict, now: float) -> None:
        c = slot.spec
        extra = {"K8SRIG_POD_IP": self.ip, "KUBERNETES_SERVICE_HOST": HOST_IP,
                 "KUBERNETES_SERVICE_PORT": str(self.runner.api_port), **self.runner.marker_env}
        kc = self.pod_kubeconfig(c)
        if kc:
            extra["KUBECONFIG"] = kc
        workdir = self.dir / "containers" / c["name"]
        workdir.mkdir(parents=True, exist_ok=True)
        try:
            spec = ps.container_process(pod, c, pod_ip=self.ip, host_ip=HOST_IP, images=self.runner.images,
                                        lookup=self._lookup_data, base_env=self.runner.base_env,
                                        mounts=self.mounts_for(c), workdir=str(workdir), extra_env=extra)
        except ImageNotRunnable as e:
            slot.run.state, slot.run.reason, slot.run.message = "waiting", "ErrImagePull", str(e)
            slot.next_start = now + 5
            return
        except (ps.ConfigError, ValueError, ApiError, OSError) as e:
            slot.run.state, slot.run.reason, slot.run.message = "waiting", "CreateContainerConfigError", str(e)
            slot.next_start = now + 1
            return
        argv = spec.argv
        found = config_arg(argv, self.runner.images.config_flags(c["image"]))
        if found is not None:                 # e.g. Envoy: listeners on 0.0.0.0 must bind the pod IP here
            index, path = found
            try:
                text = Path(path).read_text()
            except OSError as e:
                slot.run.state, slot.run.reason, slot.run.message = "waiting", "CreateContainerConfigError", str(e)
                slot.next_start = now + 1
                return
            copy = workdir / f"config-{Path(path).name}"
            copy.write_text(ps.bind_address_in_config(text, self.ip))
            argv = argv[:index] + [argv[index].replace(path, str(copy))] + argv[index + 1:]
        try:
            slot.proc = self.runner.groups.start(self.in_pod(argv), env=spec.env, cwd=spec.cwd,
                                                 log_path=self.dir / f"{c['name']}.log")
        except OSError as e:
            slot.run.state, slot.run.reason, slot.run.message = "waiting", "RunContainerError", str(e)
            slot.next_start = now + 1
            return
        if slot.run.started_at is not None or slot.run.last_terminated is not None:
            slot.run.restart_count += 1
        slot.spec_env, slot.cwd = spec.env, spec.cwd
        slot.run.state, slot.run.reason, slot.run.message = "running", "", ""
        slot.run.started_at, slot.run.pid, slot.run.exit_code = now, slot.proc.pid, None
        slot.run.ready = False
        slot.started_ok = "startupProbe" not in c
        slot.probes = {k: ps.probe_initial(k) for k in ("readiness", "liveness", "startup")}
        log.info("%s/%s: started %s as pid %d on %s: %s", *self.key, c["name"], slot.proc.pid, self.ip,
                 " ".join(argv))

    def container_exited(self, slot: ContainerSlot, code: int, now: float, reason: str = "") -> None:
        self.runner.groups.forget(slot.proc)
        slot.proc = None
        run = slot.run
        term = {"exitCode": code, "reason": reason or ("Completed" if code == 0 else "Error"),
                "startedAt": ps.rfc3339(run.started_at or now), "finishedAt": ps.rfc3339(now),
                "containerID": f"k8srig://{run.pid}"}
        run.ready = False
        policy = self.pod["spec"].get("restartPolicy", "Always")
        if slot.init and policy == "Always":
            policy = "OnFailure"         # a completed init container is never run again
        log.info("%s/%s: container %s exited with %d", *self.key, run.name, code)
        if ps.should_restart(policy, code):
            ran_for = now - (run.started_at or now)
            # Like the kubelet: the first restart is immediate, then base, 2*base, ... up to the cap; a run that
            # lasted longer than twice the cap resets the back-off.
            restarts = 0 if ran_for > 2 * self.runner.backoff_cap_s else run.restart_count
            delay = ps.crash_backoff_s(restarts, self.runner.backoff_base_s, self.runner.backoff_cap_s)
            run.last_terminated = term
            run.state, run.reason = "waiting", ("CrashLoopBackOff" if delay > 0 else "ContainerCreating")
            run.message = f"back-off {delay:.0f}s restarting failed container={run.name}" if delay > 0 else ""
            slot.next_start = now + delay
        else:
            run.state, run.exit_code, run.finished_at = "terminated", code, now
            run.reason, run.message = term["reason"], ""
            run.ready = slot.init and code == 0
            slot.next_start = float("inf")

    def probe(self, slot: ContainerSlot, now: float) -> None:
        c, run = slot.spec, slot.run
        started = run.started_at or now
        order = [("startup", "startupProbe")] if not slot.started_ok else \
            [("liveness", "livenessProbe"), ("readiness", "readinessProbe")]
        for kind, key in order:
            probe = c.get(key)
            if not probe or not ps.probe_due(slot.probes[kind], probe, started, now):
                continue
            try:
                check = ps.probe_check(probe, c, self.ip)
                ok = run_probe(check, slot.spec_env, slot.cwd, self.in_pod)
            except ValueError as e:
                log.warning("%s/%s: %s", *self.key, e)
                ok = False
            before = slot.probes[kind].result
            slot.probes[kind] = ps.probe_record(slot.probes[kind], probe, ok, time.time())
            after = slot.probes[kind].result
            if kind == "startup" and after:
                slot.started_ok = True
            liveness_lost = kind == "liveness" and before and not after
            startup_failed = kind == "startup" and slot.probes[kind].failures >= int(probe.get("failureThreshold", 3))
            if liveness_lost or startup_failed:
                log.info("%s/%s: %s probe failed, killing container %s", *self.key, kind, run.name)
                code = self.runner.groups.stop(slot.proc, self.grace_s()) if slot.proc else 137
                self.container_exited(slot, code if code is not None else 137, time.time())
                return
        if "readinessProbe" in c:
            run.ready = slot.started_ok and slot.probes["readiness"].result
        else:
            run.ready = slot.started_ok

    def grace_s(self) -> float:
        pod = self.pod
        g = pod["metadata"].get("deletionGracePeriodSeconds")
        if g is None:
            g = pod["spec"].get("terminationGracePeriodSeconds", 30)
        return float(min(max(g, 0), STOP_GRACE_CAP_S))

    def active_slots(self) -> list[ContainerSlot]:
        """The init container to run now (one at a time, in order), or, once all succeeded, the containers."""
        for slot in self.init_slots:
            r = slot.run
            if r.state == "terminated" and r.exit_code == 0:
                continue
            return [] if r.state == "terminated" else [slot]      # a failed init container fails the pod
        return self.slots

    def run_pre_stop_hooks(self, grace_s: float) -> float:
        """The kubelet's first step of a deletion: each running container's `lifecycle.preStop` exec hook, all
        at once, while the containers still serve; the hooks share the pod's grace period (a hook still running
        when it is spent is abandoned). Returns the seconds they took. (httpGet hooks are not run here.)"""
        began = time.monotonic()
        hooks = []
        for slot in self.slots:
            command = ((slot.spec.get("lifecycle") or {}).get("preStop") or {}).get("exec", {}).get("command")
            if slot.proc is not None and command:
                hooks.append((slot, list(command)))
        if not hooks:
            return 0.0

        def run(slot: ContainerSlot, command: list[str]) -> None:
            try:
                subprocess.run(self.in_pod(command), env=slot.spec_env, cwd=slot.cwd, stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=max(0.1, grace_s))
            except (OSError, subprocess.TimeoutExpired) as e:
                log.warning("%s/%s: preStop hook of %s: %s", *self.key, slot.run.name, e)

        threads = [threading.Thread(target=run, args=hook, daemon=True) for hook in hooks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=max(0.0, grace_s - (time.monotonic() - began)))
        took = time.monotonic() - began
        log.info("%s/%s: preStop hooks done in %.1fs", *self.key, took)
        return took

    def stop_all(self, grace_s: float) -> None:
        for slot in self.init_slots + self.slots:
            if slot.proc is not None:
                code = self.runner.groups.stop(slot.proc, grace_s)
                log.info("%s/%s: stopped container %s (exit %s)", *self.key, slot.run.name, code)
                slot.proc = None

    def write_status(self, pod: dict, now: float) -> None:
        status = ps.pod_status(pod, [s.run for s in self.slots], pod_ip=self.ip, host_ip=HOST_IP,
                               start_time=self.start_time, now=now, previous=self.last_status,
                               init_runs=[s.run for s in self.init_slots])
        if not ps.status_changed(self.last_status, status):
            return
        try:
            self.runner.client.patch(CORE["Pod"], self.key[1], {"status": status}, self.key[0], sub="status")
            self.last_status = status
        except ApiError as e:
            if e.status != 404:
                log.warning("%s/%s: status patch failed: %s", *self.key, e)
        except OSError as e:
            log.warning("%s/%s: status patch failed: %s", *self.key, e)

    def run(self) -> None:
        try:
            self._run()
        except Exception:
            log.exception("%s/%s: worker crashed; stopping its containers", *self.key)
            self.stop_all(1.0)
        finally:
            if self.cgroup is not None:  # before leaving the runner's table: no later worker may share its path
                podnet.remove_cgroup(self.cgroup)
            self.runner.worker_done(self)

    def join_network(self, stop: threading.Event) -> bool:
        """With NetworkPolicy enforced: the pod's cgroup, and its rules loaded, before any container starts."""
        if self.runner.cgroups is None:
            return True
        self.cgroup = self.runner.cgroups.create(self.uid)
        while not stop.is_set():
            with self.lock:
                if self.gone:
                    self.completed = True
                    return False
            try:
                self.runner.policy.sync()
                return True
            except Exception as e:  # noqa: BLE001 - the API server or nft failing: the pod waits, as on a CNI error
                log.warning("%s/%s: network policy not loaded yet: %s", *self.key, e)
                stop.wait(1.0)
        return False

    def _run(self) -> None:
        stop = self.runner.stop_event
        if not self.join_network(stop):
            return
        while not stop.is_set():
            now = time.time()
            with self.lock:
                pod, gone = self.pod, self.gone
            if gone:
                self.stop_all(1.0)
                self.completed = True
                return
            if pod["metadata"].get("deletionTimestamp"):
                grace = self.grace_s()
                self.stop_all(max(PRE_STOP_MIN_TERM_S, grace - self.run_pre_stop_hooks(grace)))
                for s in self.init_slots + self.slots:
                    if s.run.state == "running":
                        s.run.state, s.run.reason = "terminated", "Completed"
                try:
                    self.runner.client.delete(CORE["Pod"], self.key[1], self.key[0], grace_period_s=0,
                                              uid=self.uid)
                except (ApiError, OSError) as e:
                    if getattr(e, "status", None) not in (404, 409):
                        log.warning("%s/%s: final delete failed: %s", *self.key, e)
                        time.sleep(1)
                        continue
                log.info("%s/%s: deleted", *self.key)
                self.completed = True
                return
            if now >= self.next_volume_refresh:
                self.refresh_volumes(pod)
                self.next_volume_refresh = now + VOLUME_REFRESH_S
            for slot in self.active_slots():
                if slot.proc is not None:
                    code = slot.proc.poll()
                    if code is not None:
                        self.container_exited(slot, code, now)
                        continue
                    self.probe(slot, now)
                elif slot.run.state == "waiting" and now >= slot.next_start:
                    if not self.mounts_ready:
                        slot.run.reason, slot.run.message = "ContainerCreating", self.volume_error
                        continue
                    self.start_container(slot, pod, now)
            self.write_status(pod, now)
            stop.wait(TICK_S)
        self.stop_all(5.0)


# --- the node ------------------------------------------------------------------------------------------------

class Runner:
    def __init__(self, client: Client, *, node_name: str, run_dir: Path, pod_network: str,
                 images: ImageTable, backoff_base_s: float, backoff_cap_s: float,
                 network_policy_nft: str | None = None, rig_id: str = ""):
        self.client, self.node_name, self.run_dir = client, node_name, run_dir
        self.images = images
        self.backoff_base_s, self.backoff_cap_s = backoff_base_s, backoff_cap_s
        self.network = pod_network                      # "127.N": pods get 127.N.x.y
        self.groups = ProcessGroups(run_dir / "pgids")
        self.stop_event = threading.Event()
        self.workers: dict[tuple[str, str], PodWorker] = {}
        self.workers_lock = threading.Lock()
        self.unbound: dict[tuple[str, str], str] = {}   # pods whose binding failed: key -> uid (bind_retry_loop)
        self.finished: dict[str, float] = {}  # uids of pods this node deleted or saw gone -> when (see observe)
        self._next_ip = 1
        self.api_port = int(client.config.server.rsplit(":", 1)[1].rstrip("/"))
        self.marker_env = {k: v for k, v in os.environ.items() if k == "K8SRIG_ID"}
        self.base_env = {k: os.environ[k] for k in ps.PASSTHROUGH_ENV if k in os.environ}
        self.cgroups: podnet.PodCgroups | None = None
        self.policy: podnet.PolicyAgent | None = None
        if network_policy_nft:
            self.cgroups = podnet.PodCgroups(rig_id)
            self.policy = podnet.PolicyAgent(client, nft=network_policy_nft, rig_id=rig_id, cgroups=self.cgroups,
                                             pods=self.policy_pods)

    def policy_pods(self) -> list[netpol.PodInfo]:
        with self.workers_lock:
            workers = list(self.workers.values())
        return [info for w in workers if (info := w.policy_info()) is not None]

    def allocate_ip(self) -> str:
        """Never reuse an address within a run: a replacement pod always gets a new IP."""
        n = self._next_ip
        self._next_ip += 1
        x, y = divmod(n, 254)
        if x >= SERVICE_BLOCK:  # the addresses above are the Services' (controlplane.service_cidr)
            raise RuntimeError("pod network exhausted")
        return f"{self.network}.{x}.{y + 1}"

    # node --------------------------------------------------------------------------------------------------
    def node_status(self, now: float) -> dict:
        mem_kib = 0
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_kib = int(line.split()[1])
        cap = {"cpu": str(os.cpu_count() or 1), "memory": f"{mem_kib}Ki", "pods": "110",
               "ephemeral-storage": f"{shutil.disk_usage(self.run_dir).total // 1024}Ki"}
        ts = ps.rfc3339(now)
        conds = [("MemoryPressure", "False", "KubeletHasSufficientMemory"),
                 ("DiskPressure", "False", "KubeletHasNoDiskPressure"),
                 ("PIDPressure", "False", "KubeletHasSufficientPID"),
                 ("Ready", "True", "KubeletReady")]
        return {
            "capacity": cap, "allocatable": cap,
            "conditions": [{"type": t, "status": s, "reason": r, "message": "k8srig pod runner",
                            "lastHeartbeatTime": ts, "lastTransitionTime": self._node_since} for t, s, r in conds],
            "addresses": [{"type": "InternalIP", "address": HOST_IP}, {"type": "Hostname", "address": self.node_name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
            "nodeInfo": {"machineID": "", "systemUUID": "", "bootID": "", "kernelVersion": os.uname().release,
                         "osImage": "k8srig", "containerRuntimeVersion": "k8srig://processes",
                         "kubeletVersion": "v1.20.2", "kubeProxyVersion": "v1.20.2",
                         "operatingSystem": "linux", "architecture": "amd64"},
        }

    def register_node(self) -> None:
        self._node_since = ps.rfc3339(time.time())
        node = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": self.node_name,
                             "labels": {"kubernetes.io/hostname": self.node_name, "kubernetes.io/os": "linux",
                                        "kubernetes.io/arch": "amd64", "k8srig.dev/pod-runner": "true"}},
                "spec": {"podCIDR": f"{self.network}.0.0/16", "podCIDRs": [f"{self.network}.0.0/16"]}}
        try:
            self.client.create(CORE["Node"], node)
        except ApiError as e:
            if e.status != 409:
                raise
        self.heartbeat()

    def heartbeat(self) -> None:
        now = time.time()
        self.client.patch(CORE["Node"], self.node_name, {"status": self.node_status(now)}, sub="status")
        lease = self.client.get_or_none(LEASE, self.node_name, "kube-node-lease")
        spec = {"holderIdentity": self.node_name, "leaseDurationSeconds": 40, "renewTime": microtime(now)}
        if lease is None:
            node = self.client.get(CORE["Node"], self.node_name)
            self.client.create(LEASE, {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                                       "metadata": {"name": self.node_name, "namespace": "kube-node-lease",
                                                    "ownerReferences": [{"apiVersion": "v1", "kind": "Node",
                                                                         "name": self.node_name,
                                                                         "uid": node["metadata"]["uid"]}]},
                                       "spec": spec}, "kube-node-lease")
        else:
            self.client.patch(LEASE, self.node_name, {"spec": spec}, "kube-node-lease")

    def heartbeat_loop(self) -> None:
        while not self.stop_event.wait(HEARTBEAT_S):
            try:
                self.heartbeat()
            except (ApiError, OSError) as e:
                log.warning("heartbeat failed: %s", e)

    # pods --------------------------------------------------------------------------------------------------
    def bind(self, pod: dict) -> None:
        """Bind a pending pod to this node. A binding the API server refuses (overloaded, timed out, restarting)
        is tried again by bind_retry_loop: no further watch event may come for a pod nobody has bound."""
        md = pod["metadata"]
        key = (md["namespace"], md["name"])
        body = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": md["name"], "uid": md["uid"]},
                "target": {"apiVersion": "v1", "kind": "Node", "name": self.node_name}}
        try:
            self.client.request("POST", CORE["Pod"].path(md["namespace"], md["name"], "binding"), body)
            log.info("%s/%s: bound to %s", md["namespace"], md["name"], self.node_name)
        except (ApiError, OSError) as e:
            if getattr(e, "status", None) not in (404, 409):   # 404: gone; 409: already bound
                log.warning("%s/%s: binding failed (trying again in %.0fs): %s", *key, BIND_RETRY_S, e)
                with self.workers_lock:
                    self.unbound[key] = md["uid"]
                return
        with self.workers_lock:
            self.unbound.pop(key, None)

    def bind_retry_loop(self) -> None:
        while not self.stop_event.wait(BIND_RETRY_S):
            with self.workers_lock:
                pending = list(self.unbound.items())
            for key, uid in pending:
                try:
                    pod = self.client.get_or_none(CORE["Pod"], key[1], key[0])
                except (ApiError, OSError) as e:
                    log.warning("%s/%s: reading the pod to bind it: %s", *key, e)
                    continue
                if (pod is None or pod["metadata"]["uid"] != uid or pod["metadata"].get("deletionTimestamp")
                        or (pod.get("spec") or {}).get("nodeName")):
                    with self.workers_lock:
                        self.unbound.pop(key, None)
                    continue
                self.bind(pod)

    def observe(self, event_type: str, pod: dict) -> None:
        md, spec = pod["metadata"], pod.get("spec") or {}
        key = (md["namespace"], md["name"])
        if event_type == "DELETED":
            with self.workers_lock:
                w = self.workers.get(key)
            if w and w.uid == md["uid"]:
                w.mark_gone()
            return
        node = spec.get("nodeName")
        if not node:
            if not md.get("deletionTimestamp") and spec.get("schedulerName", "default-scheduler") == "default-scheduler":
                self.bind(pod)
            return
        if node != self.node_name:
            return
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed") and key not in self.workers:
            return
        with self.workers_lock:
            if md["uid"] in self.finished:
                # A late event (the watch lags the worker's final delete) for a pod this node already ran to
                # its end: a kubelet never starts a pod UID twice. (A second worker here once shared the first
                # one's cgroup path, which the first removed as it left: every NetworkPolicy load then failed
                # on the missing path, and every pod created after it stayed Pending.)
                return
            w = self.workers.get(key)
            if w is not None and w.uid != md["uid"]:
                w.mark_gone()       # an old pod of the same name; its worker finishes on its own
                w = None
            if w is None:
                w = PodWorker(self, pod)
                self.workers[key] = w
                w.start()
                return
        w.update(pod)

    def worker_done(self, worker: PodWorker) -> None:
        with self.workers_lock:
            if self.workers.get(worker.key) is worker:
                del self.workers[worker.key]
            if worker.completed:
                now = time.monotonic()
                self.finished[worker.uid] = now
                for uid in [u for u, t in self.finished.items() if now - t > FINISHED_MEMORY_S]:
                    del self.finished[uid]
        if self.policy is not None:
            self.policy.wake()

    def pods_loop(self) -> None:
        rv, listed_at = None, 0.0
        while not self.stop_event.is_set():
            try:
                if rv is None or time.monotonic() - listed_at > RELIST_S:
                    listed_at = time.monotonic()
                    listing = self.client.list(CORE["Pod"])
                    rv = listing["metadata"]["resourceVersion"]
                    seen = set()
                    for pod in listing["items"]:
                        seen.add((pod["metadata"]["namespace"], pod["metadata"]["name"], pod["metadata"]["uid"]))
                        self.observe("ADDED", pod)
                    with self.workers_lock:
                        stale = [w for k, w in self.workers.items() if (*k, w.uid) not in seen]
                    for w in stale:
                        w.mark_gone()
                for ev in self.client.watch(CORE["Pod"], resource_version=rv, timeout_s=30):
                    if self.stop_event.is_set():
                        return
                    if ev["type"] == "ERROR":
                        rv = None
                        break
                    rv = ev["object"]["metadata"].get("resourceVersion", rv)
                    if ev["type"] != "BOOKMARK":
                        self.observe(ev["type"], ev["object"])
            except (ApiError, OSError, ValueError) as e:
                log.warning("pod watch: %s; re-listing", e)
                rv = None
                self.stop_event.wait(1.0)
            except Exception:  # noqa: BLE001 - a kubelet's pod loop never dies: a dead one strands every new pod
                log.exception("pod watch crashed; re-listing")
                rv = None
                self.stop_event.wait(1.0)

    def run(self) -> None:
        self.register_node()
        threads = [threading.Thread(target=self.heartbeat_loop, name="heartbeat", daemon=True),
                   threading.Thread(target=self.pods_loop, name="pods", daemon=True),
                   threading.Thread(target=self.bind_retry_loop, name="bind-retry", daemon=True),
                   threading.Thread(target=ServiceProxy(self.client).run, args=(self.stop_event,),
                                    name="service-proxy", daemon=True)]
        if self.policy is not None:
            threads.append(threading.Thread(target=self.policy.run, args=(self.stop_event,), name="network-policy",
                                            daemon=True))
        for t in threads:
            t.start()
        log.info("node %s ready; pods get %s.x.y; NetworkPolicy %s", self.node_name, self.network,
                 "enforced (nftables, a cgroup per pod)" if self.policy else "not enforced")
        self.stop_event.wait()
        with self.workers_lock:
            workers = list(self.workers.values())
        for w in workers:
            w.join(timeout=15)
        for f in self.groups.dir.iterdir():          # anything a crashed worker left behind
            try:
                os.killpg(int(f.name), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
            f.unlink(missing_ok=True)
        if self.policy is not None:
            self.policy.close()
            podnet.remove_cgroup(self.cgroups.rig_dir)
        log.info("stopped")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="k8srig.podrunner", description=__doc__.split("\n\n")[0])
    ap.add_argument("--kubeconfig", required=True)
    ap.add_argument("--run-dir", required=True, type=Path)
    ap.add_argument("--node-name", default="k8srig-node")
    ap.add_argument("--pod-network", default="127.1", help="pods get addresses NETWORK.x.y (a /16 of 127/8)")
    ap.add_argument("--backoff-base", type=float, default=10.0, help="CrashLoopBackOff base seconds (kubelet: 10)")
    ap.add_argument("--backoff-cap", type=float, default=300.0, help="CrashLoopBackOff cap seconds (kubelet: 300)")
    ap.add_argument("--network-policy-nft", default=None, metavar="NFT",
                    help="enforce NetworkPolicy (ingress) with this nft binary and a cgroup per pod (podnet.py)")
    ap.add_argument("--rig-id", default=os.environ.get(procs.MARKER, "local"),
                    help="names the nftables table and the cgroup folder")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(threadName)s %(message)s")
    runner = Runner(Client.from_kubeconfig(a.kubeconfig), node_name=a.node_name, run_dir=a.run_dir,
                    pod_network=a.pod_network, images=ImageTable(Programs.discover(), find_vllm=vllm_venv.find_python),
                    backoff_base_s=a.backoff_base, backoff_cap_s=a.backoff_cap,
                    network_policy_nft=a.network_policy_nft, rig_id=a.rig_id)
    signal.signal(signal.SIGTERM, lambda *_: runner.stop_event.set())
    signal.signal(signal.SIGINT, lambda *_: runner.stop_event.set())
    runner.run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
