"""Start the rig by hand:  .venv/bin/python tests/e2e/k8srig [--keep]

Builds the control plane if needed, starts it, prints the kubeconfig path, and runs until Ctrl-C (or
SIGTERM), then stops every process it started.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

if __package__ in (None, ""):            # run as `python tests/e2e/k8srig`: make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "k8srig"

from k8srig import BuildFailed, Rig, Unavailable, ensure_binaries  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(prog="k8srig", description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", action="store_true", help="keep the run folder (logs, certs) after stopping")
    ap.add_argument("--backoff-base", type=float, default=10.0, help="CrashLoopBackOff base seconds")
    a = ap.parse_args()
    try:
        binaries = ensure_binaries()
    except (Unavailable, BuildFailed) as e:
        print(f"k8srig: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    rig = Rig(binaries, keep_dir=a.keep, backoff_base_s=a.backoff_base, backoff_cap_s=300.0)
    rig.start()
    try:
        print(f"k8srig {rig.id}: Kubernetes v1.20.2 ready in {rig.timings['start_s']:.1f}s; "
              f"pods on {rig.pod_network}.x.y; logs in {rig.dir}/logs")
        print(f"export KUBECONFIG={rig.kubeconfig}", flush=True)
        stop.wait()
    finally:
        leftovers = rig.stop()
        print(f"k8srig {rig.id}: stopped" + (f" (killed leftovers {leftovers})" if leftovers else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
