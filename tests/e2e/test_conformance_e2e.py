"""The conformance port against the rig: our operator is the Gateway implementation, our EPP stands in for
upstream's test EPP, and `kvgate conformance` runs every ported test and writes its report.

As a user runs it: `kvgate conformance --gateway-class NAME --kubeconfig ... --epp-image ...
--report-output report.yaml`, as a process, against the rig's real API server. The operator runs as a local
process with `--epp-address-mode pod-ip` (the rig has no Service DNS); the Gateways' addresses are their
Services' cluster IPs, which the rig routes on loopback.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import time

import pytest
import yaml
from k8srig.kube import CORE, delete_namespace
from operator_run import KVGATE, install_crds, print_log_tail, start_operator, stop_operator

pytestmark = pytest.mark.e2e
SUITE_TIMEOUT_S = 900


def test_conformance_suite_passes_on_the_rig(k8s, tmp_path):
    client = k8s.client
    install_crds(k8s)
    gc_res = client.resource_for("gateway.networking.k8s.io/v1", "GatewayClass", wait_s=30)
    class_name = f"kvgate-conformance-{secrets.token_hex(2)}"
    env = dict(os.environ, KUBECONFIG=str(k8s.kubeconfig), PYTHONUNBUFFERED="1")
    operator_log, suite_log, report_path = tmp_path / "operator.log", tmp_path / "conformance.log", tmp_path / "report.yaml"
    operator = None
    t0 = time.monotonic()
    try:
        operator = start_operator(k8s.kubeconfig, operator_log)
        client.apply({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "GatewayClass",
                      "metadata": {"name": class_name},
                      "spec": {"controllerName": "kvgate.dev/gateway-controller"}})
        with open(suite_log, "wb") as log:
            suite = subprocess.run(
                [KVGATE, "conformance", "--gateway-class", class_name, "--kubeconfig", str(k8s.kubeconfig),
                 "--epp-image", "ghcr.io/kvgate/kvgate:latest", "--report-output", str(report_path),
                 "--timeout-scale", "0.5"],
                stdout=log, stderr=subprocess.STDOUT, env=env, timeout=SUITE_TIMEOUT_S)
        elapsed = time.monotonic() - t0
        output = suite_log.read_text()
        print(output[-8000:])
        assert report_path.exists(), f"no report written (exit {suite.returncode})"
        report = yaml.safe_load(report_path.read_text())
        core = report["profiles"][0]["core"]
        print(f"[conformance-e2e] {core['statistics']} in {elapsed:.0f}s; report {report_path}")
        failed = {t["name"]: t.get("reason", "") for t in report["tests"] if t["result"] != "Passed"}
        assert not failed, "not passed:\n" + "\n".join(f"- {n}: {why[:1500]}" for n, why in failed.items())
        assert core["statistics"]["Passed"] == len(report["tests"]) == 14
        assert suite.returncode == 0
        assert operator.poll() is None, "the operator exited"
    except BaseException:
        print_log_tail(operator_log)
        raise
    finally:
        stop_operator(operator)
        client.delete(gc_res, class_name)
        for ns in ("inference-conformance-infra", "inference-conformance-app-backend"):
            if client.get_or_none(CORE["Namespace"], ns) is not None:
                delete_namespace(client, ns, timeout_s=120)
