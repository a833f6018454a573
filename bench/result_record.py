"""What every bench result file records beside its numbers, so that a figure can be traced to the code and the
machine that gave it: the commit (and whether the tree had changes), torch / triton / transformers versions, the
CUDA runtime and driver versions where there is a GPU, the device's name, the host, and the date (UTC)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    """A short command's stripped stdout; None when it is missing or fails (bounded: 10 s)."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=10, cwd=cwd)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def commit() -> dict:
    """The commit of the checkout this code is in, else of the working directory's (an installed wheel run from
    the repository), and whether tracked files differ from it; else $KVGATE_COMMIT (a copy of the tree without
    git, given by whoever copied it; dirty then unknown), else None."""
    for where in (_REPO, Path.cwd()):
        sha = _run(["git", "rev-parse", "HEAD"], where)
        if sha:
            status = _run(["git", "status", "--porcelain", "--untracked-files=no"], where)
            return {"commit": sha, "dirty": bool(status) if status is not None else None}
    return {"commit": os.environ.get("KVGATE_COMMIT") or None, "dirty": None}


def device_name(device) -> str:
    """torch's name of a CUDA device; for a CPU the processor's (platform), else "cpu"."""
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or "cpu"


def environment(device) -> dict:
    """The record described in the module doc, for `device` (a torch.device or its name; None: a server this
    process did not start, whose device it cannot see)."""
    import torch

    if device is None:
        return {**commit(), "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "device_name": None, "device_type": None, "torch": torch.__version__, "host": platform.node()}
    is_cuda = getattr(device, "type", str(device)).startswith("cuda")
    driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]) if is_cuda else None
    return {
        **commit(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device_name": device_name(torch.device(device) if isinstance(device, str) else device),
        "device_type": "cuda" if is_cuda else "cpu",
        "torch": torch.__version__, "triton": _version("triton"), "transformers": _version("transformers"),
        "kvgate": _version("kvgate"),
        "cuda_runtime": torch.version.cuda if is_cuda else None,
        "driver": driver.splitlines()[0] if driver else None,
        "host": platform.node(), "cpu_count": _cpu_count(), "python": platform.python_version(),
    }


def _cpu_count() -> int | None:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def write_result(path: str | Path, payload: dict, device) -> None:
    """`payload` with the environment record under "environment", as indented JSON at `path`."""
    Path(path).write_text(json.dumps({**payload, "environment": environment(device)}, indent=2, default=str))
