"""Where the control-plane binaries come from: KVGATE_E2E_ASSETS, the build cache, or a build (once).

The build itself is tests/e2e/k8s/build-control-plane (shell: apt, `apt-get source kubernetes`, make).
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from . import procs

BUILD_SCRIPT = Path(__file__).resolve().parent.parent / "k8s" / "build-control-plane"
K8S_VERSION = "v1.20.2"
BUILD_TIMEOUT_S = 1500          # apt + source download + a cold make on 2 cores is ~6 min
UNAVAILABLE_EXIT = 3            # the script's "this machine cannot build it"


class Unavailable(Exception):
    """The control plane cannot be built on this machine (the e2e tier skips with this message)."""


class BuildFailed(Exception):
    """The build was possible but failed (the e2e tier fails with this message)."""


@dataclass(frozen=True)
class Binaries:
    dir: Path
    built_s: float | None          # seconds spent building now; None when the cache was reused
    log: str = ""

    @property
    def apiserver(self) -> Path:
        return self.dir / "kube-apiserver"

    @property
    def controller_manager(self) -> Path:
        return self.dir / "kube-controller-manager"

    @property
    def etcd(self) -> Path:
        return self.dir / "etcd"


def cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "kvgate" / "e2e" / f"k8s-{K8S_VERSION}"


def binaries_cached(script: Path = BUILD_SCRIPT) -> bool:
    """Whether the binaries are there without building (cache or KVGATE_E2E_ASSETS)."""
    try:
        return subprocess.run(["bash", str(script), "--check"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def ensure_binaries(log_path: Path | None = None, timeout_s: float = BUILD_TIMEOUT_S,
                    script: Path = BUILD_SCRIPT) -> Binaries:
    """Return the binaries, building them first if the cache is empty. Raises Unavailable or BuildFailed."""
    check = subprocess.run(["bash", str(script), "--check"], capture_output=True, text=True, timeout=60)
    if check.returncode == 0:
        return Binaries(Path(check.stdout.strip().splitlines()[-1]), built_s=None)
    t0 = time.monotonic()
    log_path = log_path or cache_dir().parent / "build.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        # Its own process group, so that an interrupted build (timeout, Ctrl-C) takes make and go with it.
        proc = subprocess.Popen(["bash", str(script)], stdout=subprocess.PIPE, stderr=log, text=True,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except BaseException as e:
            procs.kill_group(proc.pid, signal.SIGKILL)
            proc.wait()
            if isinstance(e, subprocess.TimeoutExpired):
                raise BuildFailed(f"control-plane build timed out after {timeout_s:.0f}s; log: {log_path}") from None
            raise
    tail = log_path.read_text(errors="replace").strip().splitlines()[-15:]
    if proc.returncode == UNAVAILABLE_EXIT:
        reason = next((ln.split("UNAVAILABLE: ", 1)[1] for ln in reversed(tail) if "UNAVAILABLE: " in ln),
                      "the build script says this machine cannot build it")
        raise Unavailable(reason)
    if proc.returncode != 0:
        raise BuildFailed(f"control-plane build failed (exit {proc.returncode}); log: {log_path}\n" + "\n".join(tail))
    return Binaries(Path(out.strip().splitlines()[-1]), built_s=time.monotonic() - t0, log=str(log_path))
