"""The conformance suite: a registry of tests, the runner, and the report.

A test is a function `(ctx: Context) -> None` registered with `@conformance_test(...)`: it names the upstream
test it ports, the manifests it applies (after the shared base.yaml), and the features it needs. It raises
AssertionError (ConformanceError) to fail; anything else is an error of the run, reported as a failure too.
The runner applies base.yaml once, waits for the base to be ready, runs the selected tests in order (each
applies its manifests and deletes them afterwards), and writes a ConformanceReport YAML shaped like
upstream's.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import yaml

from kvgate.conformance import resources as res
from kvgate.conformance.cluster import Cluster, ConformanceError, wait_until
from kvgate.conformance.timing import Timing
from kvgate.conformance.traffic import Gateway

log = logging.getLogger("kvgate.conformance")

REPORT_API_VERSION = "gateway.networking.k8s.io/v1"
GIE_VERSION = "v1.0.0"        # the Inference Extension API the ported suite targets
PROFILE = "Gateway"


@dataclass
class ConformanceTest:
    short_name: str
    description: str
    manifests: tuple[str, ...]
    features: tuple[str, ...]
    run: Callable[["Context"], None]
    extended: bool = False


TESTS: list[ConformanceTest] = []


def conformance_test(short_name: str, description: str, manifests: tuple[str, ...] = (),
                     features: tuple[str, ...] = ("SupportInferencePool", "SupportGateway"), extended: bool = False):
    def register(fn: Callable[["Context"], None]) -> Callable[["Context"], None]:
        TESTS.append(ConformanceTest(short_name, description, manifests, features, fn, extended))
        return fn
    return register


@dataclass
class Context:
    """What a test gets: the cluster, the timing, its own applied documents, and gateway clients."""
    cluster: Cluster
    timing: Timing
    test: ConformanceTest
    applied: list[dict] = field(default_factory=list)
    _gateways: dict[str, Gateway] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)

    def say(self, line: str) -> None:
        self.log.append(line)
        log.info("[%s] %s", self.test.short_name, line)

    def gateway(self, nn: tuple[str, str]) -> Gateway:
        """A client for a Gateway's address (waits until the Gateway has one)."""
        key = "/".join(nn)
        if key not in self._gateways:
            address = wait_until(lambda: _address_or_none(self.cluster, nn), self.timing.gateway_address_s,
                                 f"Gateway {key} to have an address")
            self._gateways[key] = Gateway(address, timeout_s=self.timing.request_timeout_s)
            self.say(f"Gateway {key} at {address}")
        return self._gateways[key]

    def close(self) -> None:
        for gw in self._gateways.values():
            gw.close()


def _address_or_none(cluster: Cluster, nn: tuple[str, str]) -> str | None:
    try:
        return cluster.gateway_address(nn[0], nn[1])
    except ConformanceError:
        return None


@dataclass
class Result:
    name: str
    outcome: str                   # Passed, Failed, Skipped
    seconds: float
    message: str = ""


@dataclass
class Options:
    gateway_class: str
    epp_image: str | None = None
    run_tests: tuple[str, ...] = ()          # empty: all
    skip_tests: tuple[str, ...] = ()
    supported_features: tuple[str, ...] = ()  # empty: every feature the suite knows
    cleanup_base_resources: bool = True
    implementation: dict = field(default_factory=dict)
    timing: Timing = field(default_factory=Timing)


def selected(options: Options) -> list[tuple[ConformanceTest, str | None]]:
    """Each registered test with a skip reason (None: it runs)."""
    from kvgate.conformance import cases  # noqa: F401 - registers the tests

    names = {t.short_name for t in TESTS}
    unknown = [n for n in (*options.run_tests, *options.skip_tests) if n not in names]
    if unknown:
        raise ValueError(f"unknown test(s): {', '.join(unknown)} (known: {', '.join(sorted(names))})")
    out = []
    for t in TESTS:
        why = None
        if options.run_tests and t.short_name not in options.run_tests:
            why = "not selected (--run-test)"
        elif t.short_name in options.skip_tests:
            why = "skipped (--skip-tests)"
        elif options.supported_features and not set(t.features) <= set(options.supported_features):
            why = f"needs unsupported features {sorted(set(t.features) - set(options.supported_features))}"
        out.append((t, why))
    return out


def setup_base(cluster: Cluster, timing: Timing) -> list[dict]:
    """Apply base.yaml and wait for its Gateways, backends and EPPs to be ready."""
    docs = cluster.apply("base.yaml")
    for ns, name in res.BASE_GATEWAYS:
        wait_until(lambda: _address_or_none(cluster, (ns, name)), timing.gateway_address_s,
                   f"Gateway {ns}/{name} to have an address")
    for name in res.BASE_DEPLOYMENTS:
        wait_until(lambda: _deployment_ready(cluster, res.APP_BACKEND_NS, name), timing.pods_ready_s,
                   f"Deployment {res.APP_BACKEND_NS}/{name} to be ready",
                   describe=lambda: str((cluster.get(res.DEPLOYMENT, name, res.APP_BACKEND_NS) or {}).get("status")))
    return docs


def _deployment_ready(cluster: Cluster, ns: str, name: str) -> bool:
    dep = cluster.get(res.DEPLOYMENT, name, ns)
    if not dep:
        return False
    want = (dep.get("spec") or {}).get("replicas", 1)
    status = dep.get("status") or {}
    return status.get("readyReplicas", 0) >= want and status.get("updatedReplicas", 0) >= want


def run_test(cluster: Cluster, test: ConformanceTest, timing: Timing) -> Result:
    ctx = Context(cluster, timing, test)
    t0 = time.monotonic()
    outcome, message = "Passed", ""
    try:
        for manifest in test.manifests:
            ctx.applied += cluster.apply(manifest)
        test.run(ctx)
    except AssertionError as exc:
        outcome, message = "Failed", str(exc)
    except Exception as exc:  # noqa: BLE001 - an error of the run is this test's failure, not the suite's
        outcome, message = "Failed", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=5)}"
    finally:
        ctx.close()
        try:
            cluster.delete(ctx.applied, wait_s=timing.delete_s)
        except Exception as exc:  # noqa: BLE001
            log.warning("[%s] cleanup: %s", test.short_name, exc)
    seconds = time.monotonic() - t0
    log.info("%s %s in %.1fs%s", test.short_name, outcome, seconds, f": {message}" if message else "")
    return Result(test.short_name, outcome, seconds, message)


def run(cluster: Cluster, options: Options, on_result: Callable[[Result], None] | None = None) -> list[Result]:
    plan = selected(options)
    results: list[Result] = []
    base: list[dict] = []
    try:
        if any(why is None for _, why in plan):
            base = setup_base(cluster, options.timing)
        for test, why in plan:
            result = Result(test.short_name, "Skipped", 0.0, why) if why else run_test(cluster, test, options.timing)
            results.append(result)
            if on_result:
                on_result(result)
    finally:
        if base and options.cleanup_base_resources:
            cluster.delete(base)
    return results


def report(results: list[Result], options: Options, server_version: str = "") -> dict:
    """A ConformanceReport as upstream writes it (one profile, core tests), with each failure's reason."""
    def names(outcome: str) -> list[str]:
        return sorted(r.name for r in results if r.outcome == outcome)

    passed, failed, skipped = names("Passed"), names("Failed"), names("Skipped")
    result = "success" if not failed and passed else ("failure" if failed else "partial")
    return {
        "apiVersion": REPORT_API_VERSION,
        "kind": "ConformanceReport",
        "date": dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat(),
        "gatewayAPIInferenceExtensionVersion": GIE_VERSION,
        "implementation": options.implementation,
        "mode": "default",
        "kubernetesVersion": server_version,
        "profiles": [{
            "name": PROFILE,
            "core": {
                "result": result,
                "statistics": {"Passed": len(passed), "Failed": len(failed), "Skipped": len(skipped)},
                "failedTests": failed,
                "skippedTests": skipped,
            },
            "summary": f"Core tests {result}: {len(passed)} passed, {len(failed)} failed, {len(skipped)} skipped.",
        }],
        "tests": [{"name": r.name, "result": r.outcome, "seconds": round(r.seconds, 1),
                   **({"reason": r.message} if r.message else {})} for r in results],
        "gatewayClass": options.gateway_class,
    }


def write_report(path: str, data: dict) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(data, f, sort_keys=False, width=120)
