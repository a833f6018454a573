"""Fixtures of the e2e tier: a real Kubernetes control plane (k8srig) shared by the session.

    k8s           the running rig (session): .client, .kubeconfig, .pod_network, .timings, .local
    k8s_binaries  the control-plane binaries (built once into the user cache, then reused)
    namespace     a fresh namespace per test, deleted afterwards (waiting for its pods to go)

Modes:
  * default: build or reuse kube-apiserver/kube-controller-manager (tests/e2e/k8s/build-control-plane) and
    run them with etcd and the pod runner on loopback;
  * KVGATE_E2E_ASSETS=DIR: take the three binaries from DIR instead of building them;
  * KVGATE_E2E_USE_EXISTING_CLUSTER=1: use the cluster of $KUBECONFIG (kind, GKE, ...); tests that inspect
    local processes skip there.
If the control plane cannot be built here (no Debian/apt, no root), every e2e test is skipped with one reason.
"""
from __future__ import annotations

import os
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from k8srig import BuildFailed, Rig, Unavailable, ensure_binaries  # noqa: E402
from k8srig.assets import BUILD_TIMEOUT_S, binaries_cached  # noqa: E402
from k8srig import podnet  # noqa: E402
from k8srig import objects  # noqa: E402
from k8srig.kube import CORE, Client, delete_namespace, wait_default_service_account  # noqa: E402


E2E_DIR = Path(__file__).resolve().parent
KEEP = os.environ.get("KVGATE_E2E_KEEP") == "1"     # keep the rig's folder (logs of every process, certs)
EXISTING = os.environ.get("KVGATE_E2E_USE_EXISTING_CLUSTER") == "1"


@dataclass
class ExistingCluster:
    """A cluster reached through $KUBECONFIG; no local processes to inspect."""
    kubeconfig: Path
    client: Client
    local: bool = False
    timings: dict = field(default_factory=dict)
    pod_network: str = ""


def _say(config: pytest.Config, line: str) -> None:
    """Print past pytest's output capture (the cold/warm start time belongs in every run's output)."""
    capman = config.pluginmanager.get_plugin("capturemanager")
    if capman is None:
        print(line, file=sys.stderr)
        return
    with capman.global_and_fixture_disabled():
        print(line, flush=True)


def pytest_collection_modifyitems(config, items):
    """A cold build (~5-8 min) happens inside the first e2e test's setup: give that one test room beyond
    the suite's per-test timeout. Nothing changes once the binaries are cached."""
    if EXISTING or not config.pluginmanager.hasplugin("timeout"):
        return
    first = next((i for i in items if {"k8s", "k8s_binaries"} & set(getattr(i, "fixturenames", ()))), None)
    if first is None or binaries_cached():
        return
    first.add_marker(pytest.mark.timeout(BUILD_TIMEOUT_S + 300))


@pytest.fixture(scope="session")
def k8s_binaries():
    if EXISTING:
        pytest.skip("needs the rig's own control plane (KVGATE_E2E_USE_EXISTING_CLUSTER=1 is set)")
    try:
        return ensure_binaries()
    except Unavailable as e:
        pytest.skip(f"e2e tier skipped: the Kubernetes control plane cannot be built on this machine ({e})")
    except BuildFailed as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="session")
def k8s(request):
    if EXISTING:
        kc = os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")
        yield ExistingCluster(Path(kc), Client.from_kubeconfig(kc))
        return
    t0 = time.monotonic()
    binaries = request.getfixturevalue("k8s_binaries")
    build_s = time.monotonic() - t0
    rig = Rig(binaries, keep_dir=KEEP)
    rig.start()
    rig.timings["build_s"] = build_s
    rig.timings["built"] = binaries.built_s is not None
    rig.timings["total_s"] = time.monotonic() - t0
    _say(request.config,
         f"\n[k8srig] control plane ready: total {rig.timings['total_s']:.1f}s "
         f"({'cold build' if binaries.built_s is not None else 'cached binaries'} {build_s:.1f}s + "
         f"start {rig.timings['start_s']:.1f}s; apiserver ready at {rig.timings['apiserver_ready_s']:.1f}s); "
         f"binaries {binaries.dir}; kubeconfig {rig.kubeconfig}" + (f"; logs {rig.dir}/logs" if KEEP else ""))
    _running.append(rig)
    try:
        yield rig
    finally:
        if rig in _running:            # not already stopped after the last e2e test
            _running.remove(rig)
            _stop_and_check(rig)


_running: list[Rig] = []          # the session rig while it runs


def _stop_and_check(rig: Rig) -> None:
    leftovers = rig.stop()
    assert not leftovers, f"rig teardown found processes still running (killed now): {leftovers}"
    if getattr(rig, "network_policy", "") == "enforced":   # nor its nftables table and pod cgroups
        assert not podnet.leftovers(rig.id), f"rig teardown left NetworkPolicy state: {podnet.leftovers(rig.id)}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Stop the rig as soon as the last e2e test and its fixtures are done, not at the end of the whole
    session: the rest of the suite should not share two cores with an idle control plane. Leftover processes
    are reported as a teardown error of that last e2e test. (e2e tests are collected together, and under
    pytest-xdist the tier is one unit of one worker (tests/conftest.py); a run that interleaved them with other
    tests would find the rig stopped.)"""
    try:
        return (yield)
    finally:
        if _running and (nextitem is None or E2E_DIR not in Path(str(nextitem.path)).resolve().parents):
            _stop_and_check(_running.pop())


@pytest.fixture
def namespace(k8s, request):
    name = f"e2e-{request.node.name[5:25].lower().replace('_', '-').strip('-')}-{secrets.token_hex(2)}"
    k8s.client.create(CORE["Namespace"], objects.namespace(name))
    wait_default_service_account(k8s.client, name, token=getattr(k8s, "local", False))
    yield name
    delete_namespace(k8s.client, name, wait_gone=False)
