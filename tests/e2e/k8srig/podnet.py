"""NetworkPolicy enforced on the rig's node: a cgroup per pod, and an agent keeping nftables in step.

The pod runner gives every pod a cgroup (cgroup v2) under `k8srig-<rig id>/` and starts the pod's processes
(containers, exec probes, preStop hooks) inside it; `PolicyAgent` lists the NetworkPolicies and Namespaces,
computes what each isolated pod admits (netpol.py, pure) and loads the ruleset into the nftables table
`inet k8srig_<rig id>` in one transaction whenever it changes: at most POLL_S after a policy or namespace
changes, and before a new pod's first container starts (so a pod never runs unprotected, nor is refused by a
peer that has not heard of it yet). `cleanup()` removes the table and the cgroups of a rig that is gone, even
if its pod runner was killed.

Needs root, `nft` (Debian's nftables; the control-plane build installs it) and a cgroup2 mount under
/sys/fs/cgroup (nft resolves cgroup paths there). `unavailable()` says which is missing.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from . import netpol
from .kube import CORE, ApiError, Resource

log = logging.getLogger("k8srig.podnet")

NFT_ROOT = Path("/sys/fs/cgroup")          # nft looks cgroup paths up under here
POLL_S = 0.5                               # how soon a NetworkPolicy or Namespace change is enforced
NFT_TIMEOUT_S = 20.0
NETWORK_POLICY = Resource("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies", True)


def table_name(rig_id: str) -> str:
    return "k8srig_" + re.sub(r"[^A-Za-z0-9_]", "_", rig_id)


def cgroup2_mount() -> Path | None:
    """Where cgroup v2 is mounted, if it is mounted under /sys/fs/cgroup."""
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and parts[2] == "cgroup2":
                    mount = Path(parts[1])
                    if mount == NFT_ROOT or NFT_ROOT in mount.parents:
                        return mount
    except OSError:
        pass
    return None


def own_cgroup() -> str:
    """This process's cgroup v2 path ("/" at the root)."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                return line[3:] or "/"
    except OSError:
        pass
    return "/"


def find_nft(extra_dir: Path | None = None) -> str | None:
    candidate = extra_dir / "nft" if extra_dir else None
    if candidate is not None and os.access(candidate, os.X_OK):
        return str(candidate)
    return shutil.which("nft") or next((p for p in ("/usr/sbin/nft", "/sbin/nft") if os.access(p, os.X_OK)), None)


def _nft(nft: str, script: str) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".nft", delete=False) as f:
        f.write(script)
    try:
        r = subprocess.run([nft, "-f", f.name], capture_output=True, text=True, timeout=NFT_TIMEOUT_S)
    finally:
        os.unlink(f.name)
    if r.returncode != 0:
        raise RuntimeError(f"nft -f failed ({r.returncode}): {r.stderr.strip()[-2000:]}")


def unavailable(nft: str | None) -> str | None:
    """Why NetworkPolicy cannot be enforced here, or None when it can (a throwaway rule is loaded to check)."""
    if os.geteuid() != 0:
        return "NetworkPolicy enforcement needs root (nftables, cgroups)"
    if nft is None:
        return "no `nft` (Debian's nftables) on this machine"
    mount = cgroup2_mount()
    if mount is None:
        return "no cgroup v2 mount under /sys/fs/cgroup"
    probe = mount / own_cgroup().lstrip("/") / f"k8srig-probe-{os.getpid()}"
    table = table_name(f"probe_{os.getpid()}")
    try:
        probe.mkdir(parents=True, exist_ok=True)
        _nft(nft, f"table inet {table} {{\n chain c {{\n  type filter hook output priority filter; policy accept;\n"
                  f'  socket cgroupv2 level {len(probe.relative_to(mount).parts)} '
                  f'"{probe.relative_to(NFT_ROOT)}" accept\n }}\n}}\ndelete table inet {table}\n')
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
        return f"nftables cannot match a socket's cgroup here: {e}"
    finally:
        try:
            probe.rmdir()
        except OSError:
            pass
    return None


# --- cgroups -------------------------------------------------------------------------------------------------

class PodCgroups:
    """One cgroup per pod under `<this process's cgroup>/k8srig-<rig id>`; nothing else ever runs in there."""

    def __init__(self, rig_id: str, mount: Path | None = None):
        self.mount = mount or cgroup2_mount()
        if self.mount is None:
            raise RuntimeError("no cgroup v2 mount under /sys/fs/cgroup")
        self.rig_dir = rig_cgroup_dir(self.mount, rig_id)
        self.rig_dir.mkdir(parents=True, exist_ok=True)
        self.pod_level = len(self.rig_dir.relative_to(self.mount).parts) + 1

    def nft_path(self, directory: Path) -> str:
        return str(directory.relative_to(NFT_ROOT))

    @property
    def rig_nft_path(self) -> str:
        return self.nft_path(self.rig_dir)

    def create(self, pod_uid: str) -> Path:
        d = self.rig_dir / f"pod-{pod_uid}"
        d.mkdir(exist_ok=True)
        return d

    @staticmethod
    def wrap(argv: list[str], directory: Path) -> list[str]:
        """argv run inside the cgroup: the shell moves itself in, then execs argv (its pid stays the same, so
        the process group and the pid the runner records are argv's own)."""
        procs_file = directory / "cgroup.procs"
        return ["/bin/sh", "-c", f'echo $$ > "{procs_file}" && exec "$@"', "k8srig-cgroup", *argv]


def rig_cgroup_dir(mount: Path, rig_id: str) -> Path:
    return mount / own_cgroup().lstrip("/") / f"k8srig-{rig_id}"


def remove_cgroup(directory: Path, timeout_s: float = 5.0) -> bool:
    """Kill whatever is left in the cgroup (and its children), then remove it; False if it stayed."""
    if not directory.is_dir():
        return True
    deadline = time.monotonic() + timeout_s
    while True:
        for child in [p for p in directory.iterdir() if p.is_dir()]:
            remove_cgroup(child, max(0.1, deadline - time.monotonic()))
        try:
            pids = [int(p) for p in (directory / "cgroup.procs").read_text().split()]
        except OSError:
            pids = []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            directory.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() >= deadline:
                log.warning("cgroup %s still busy; left in place", directory)
                return False
            time.sleep(0.05)


def delete_table(nft: str, table: str) -> None:
    """Remove `inet TABLE` if it exists (declaring it first makes the delete succeed either way)."""
    try:
        _nft(nft, f"table inet {table} {{}}\ndelete table inet {table}\n")
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
        log.warning("removing nftables table %s: %s", table, e)


def cleanup(rig_id: str, nft: str | None) -> None:
    """Remove a rig's nftables table and cgroups (its pod runner may be gone)."""
    if nft is not None:
        delete_table(nft, table_name(rig_id))
    mount = cgroup2_mount()
    if mount is not None:
        remove_cgroup(rig_cgroup_dir(mount, rig_id))


def leftovers(rig_id: str) -> list[str]:
    """What of a rig's NetworkPolicy state is still there (its nftables table, its cgroup folder)."""
    found = []
    nft = find_nft()
    if nft is not None:
        listed = subprocess.run([nft, "list", "tables"], capture_output=True, text=True, timeout=NFT_TIMEOUT_S)
        if f"table inet {table_name(rig_id)}" in listed.stdout.splitlines():
            found.append(f"nftables table inet {table_name(rig_id)}")
    mount = cgroup2_mount()
    if mount is not None and rig_cgroup_dir(mount, rig_id).exists():
        found.append(str(rig_cgroup_dir(mount, rig_id)))
    return found


# --- the agent -----------------------------------------------------------------------------------------------

class PolicyAgent:
    """Keeps the rig's nftables table equal to what the NetworkPolicies say about the pods of `pods()`."""

    def __init__(self, client, *, nft: str, rig_id: str, cgroups: PodCgroups, pods):
        self.client, self.nft, self.cgroups, self.pods = client, nft, cgroups, pods
        self.table = table_name(rig_id)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._loaded: str | None = None
        self._warned: set[str] = set()

    def sync(self) -> None:
        """Read the policies and namespaces, and load the ruleset if it changed (serialized)."""
        with self._lock:
            policies = self.client.list(NETWORK_POLICY)["items"]
            namespaces = {n["metadata"]["name"]: n["metadata"].get("labels") or {}
                          for n in self.client.list(CORE["Namespace"])["items"]}
            pods = list(self.pods())
            for name in netpol.egress_ignored(policies):
                if name not in self._warned:
                    self._warned.add(name)
                    log.warning("NetworkPolicy %s asks for egress isolation, which this rig does not enforce", name)
            isolations = netpol.ingress_isolations(policies, pods, namespaces)
            script = netpol.render_ruleset(self.table, isolations, {p.key: p for p in pods},
                                           pod_level=self.cgroups.pod_level, rig_cgroup=self.cgroups.rig_nft_path)
            if script == self._loaded:
                return
            _nft(self.nft, script)
            self._loaded = script
            log.info("network policy: %d isolated pod(s) of %d: %s", len(isolations), len(pods),
                     ", ".join(f"{i.pod.namespace}/{i.pod.name}" for i in isolations) or "none")

    def wake(self) -> None:
        self._wake.set()

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self._wake.wait(POLL_S)
            self._wake.clear()
            try:
                self.sync()
            except (ApiError, OSError, RuntimeError, subprocess.TimeoutExpired) as e:
                log.warning("network policy sync failed: %s", e)
            except Exception:  # noqa: BLE001 - the agent never dies: a dead one freezes every pod's rules
                log.exception("network policy sync crashed")
                stop.wait(1.0)

    def close(self) -> None:
        with self._lock:
            delete_table(self.nft, self.table)
            self._loaded = None
