"""The operator's autoscaler: every `interval_s`, each autoscaled ModelServer (spec.maxReplicas, provider operator)
gets a replica count from its pool's load. No metrics adapter: the operator reads the pool's EPP pods' /metrics
itself (autoscale_signals.py), decides (autoscale_policy.py) and records the decision in the ModelServer's status;
the ModelServer reconciler then sets the engine Deployment's replicas from it (autoscaling_spec.rendered_replicas)
— one writer of the Deployment.

Each EPP page is read over HTTP from the EPP pod's IP and metrics port, at most MAX_PAGE_BYTES (decoded) within
PAGE_TIMEOUT_S; a page that is too big, slow, malformed or out of range costs that EPP's reading only, and a pool
without any reading keeps its count (condition ScalingActive=False, reason FailedGetMetrics, and a Warning event
when it starts). The EPP's NetworkPolicy must admit the operator to the metrics port (the chart adds the
operator's pods to --epp-metrics-from when autoscaling is on).

Status: status.autoscaling (currentReplicas, desiredReplicas, specReplicas, lastScaleTime, lastScaleUpTime) and
two conditions — ScalingActive (True with the last look's reason: Steady, Stabilizing, ScaleDownDelayed, or the
scale's; False: FailedGetMetrics) and Scaled (the last change of the count: ScaledUp, ScaledDown, ScaledFromZero,
ScaledToZero, with the signals that made it). Each change is also a Normal event on the ModelServer.

With `metrics` (OperatorMetrics.autoscale, autoscale_metrics.py) each look's decision and signals are also
exported; only while this replica looks (a standby, or a stopped autoscaler, clears them).

The stabilisation windows' recommendations are kept in memory; after a restart the first look records the
running count, so no scale-down comes sooner than a full window after it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone

import httpx

from kvgate.operator import naming
from kvgate.operator.apply import (DEPLOYMENT, MODELSERVER, POD, POOL, SCALEDOBJECT, ApiError, Kube, NameConflict,
                                  describe)
from kvgate.operator.autoscale_metrics import AutoscaleMetrics
from kvgate.operator.autoscale_policy import Decision, decide
from kvgate.operator.autoscale_signals import EppReading, parse_epp_page, pool_signals
from kvgate.operator.autoscaling_spec import (AUTOSCALER_CONDITIONS, KEDA, SCALED, SCALING_ACTIVE,
                                              autoscaling_problems, is_autoscaled, policy_of, provider,
                                              rendered_replicas, spec_replicas)
from kvgate.operator.conditions import condition, stamp
from kvgate.operator.keda import desired_scaled_object
from kvgate.operator.spec_shape import modelserver_problems, pool_ref_name

log = logging.getLogger("kvgate.operator.autoscaler")

DEFAULT_INTERVAL_S = 15.0  # HPA's sync period
MAX_PAGE_BYTES = 8 * 1024 * 1024  # an EPP page of 1000 endpoints is ~2 MiB
PAGE_TIMEOUT_S = 2.0
MANAGED_SELECTOR = "app.kubernetes.io/managed-by=kvgate-operator"


def fetch_page(url: str, max_bytes: int = MAX_PAGE_BYTES, timeout_s: float = PAGE_TIMEOUT_S) -> str:
    """GET `url`'s body as text: at most `max_bytes` (decoded) within `timeout_s` overall, else ValueError."""
    deadline = time.monotonic() + timeout_s
    body = bytearray()
    with httpx.Client(timeout=timeout_s, follow_redirects=False) as client:
        with client.stream("GET", url) as response:
            if response.status_code != 200:
                raise ValueError(f"HTTP {response.status_code}")
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > max_bytes:
                    raise ValueError(f"page larger than {max_bytes} bytes")
                if time.monotonic() > deadline:
                    raise ValueError(f"page not read within {timeout_s:g}s")
    return body.decode("utf-8", errors="replace")


def _rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _epoch(text: str | None) -> float | None:
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()
    except (TypeError, ValueError):
        return None


class _State:
    """What the autoscaler remembers of one ModelServer between looks."""

    def __init__(self) -> None:
        self.history: tuple[tuple[float, int], ...] = ()
        self.readings: dict[str, EppReading] = {}
        self.failing = False


class Autoscaler:
    def __init__(self, kube: Kube, namespace: str | None, enqueue: Callable[[tuple], None],
                 interval_s: float = DEFAULT_INTERVAL_S, metrics_port: int = naming.EPP_METRICS_PORT,
                 fetch: Callable[[str], str] = fetch_page, clock: Callable[[], float] = time.time,
                 keda_prometheus_address: str | None = None, leading: threading.Event | None = None,
                 metrics: AutoscaleMetrics | None = None) -> None:
        self.kube, self.namespace, self.enqueue = kube, namespace, enqueue
        # Only the leading operator replica looks (None: always, without leader election); a standby's windows
        # start afresh when it leads, as a restarted HPA's do.
        self.leading = leading
        self.metrics = metrics
        self.keda_prometheus_address = keda_prometheus_address
        self.interval_s, self.metrics_port, self.fetch, self.clock = interval_s, metrics_port, fetch, clock
        self._states: dict[tuple[str, str], _State] = {}
        self._pages: dict[tuple[str, str], dict[str, EppReading]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="kvgate-operator-autoscaler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.stand_by()  # a stopped autoscaler's series would go stale

    def stand_by(self) -> None:
        """This replica no longer looks: its exported decisions are withdrawn (the leader's are the live ones)."""
        if self.metrics is not None:
            self.metrics.clear()

    def _looking(self) -> bool:
        return self.leading is None or self.leading.is_set()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            if not self._looking():
                self._states.clear()
                self.stand_by()
                continue
            try:
                self.run_once()
            except Exception as exc:  # the API server away, say: the next look tries again
                log.warning("autoscaler: %s", exc)
            if not self._looking():  # stopped leading during the look: what it exported is not the leader's
                self.stand_by()

    # --- one look at everything ---------------------------------------------------------------------------------
    def run_once(self) -> None:
        self._pages = {}  # each pool's EPPs are read once per look, however many ModelServers it has
        seen, keda_wanted = set(), set()
        keda_installed = None  # asked once per look, when a ModelServer wants KEDA
        for ms in self.kube.list(MODELSERVER, self.namespace):
            spec = ms.get("spec")
            if (naming.is_deleting(ms) or modelserver_problems(ms) or not is_autoscaled(spec)
                    or autoscaling_problems(spec)):  # an invalid spec is the reconciler's InvalidSpec condition
                continue
            key = naming.key_of(ms)
            try:
                if provider(spec) == KEDA:
                    keda_wanted.add(key)
                    if keda_installed is None:
                        keda_installed = self.keda_installed()
                    self.keda(ms, keda_installed)
                    continue
                seen.add(key)
                self.evaluate(ms)
            except ApiError as exc:
                log.warning("autoscaler: %s: %s", describe(ms), exc)
        for key in set(self._states) - seen:
            del self._states[key]
        if self.metrics is not None:
            self.metrics.retain(seen, set(self._pages))
        if self.keda_prometheus_address and keda_installed is not False:  # KEDA in use here (and RBAC for it)
            self._delete_unwanted_scaled_objects(keda_wanted)

    # --- KEDA -------------------------------------------------------------------------------------------------
    def keda_installed(self) -> bool:
        """Whether the API server serves KEDA's ScaledObjects (its CRDs are installed)."""
        try:
            resources = self.kube.request("GET", f"/apis/{SCALEDOBJECT.api_version}")
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return any(r.get("name") == SCALEDOBJECT.plural for r in (resources or {}).get("resources") or [])

    def keda(self, ms: dict, installed: bool) -> None:
        """A ModelServer with provider keda: its ScaledObject applied, or a condition saying why not."""
        pool_name = pool_ref_name(ms) or ""
        if not installed:
            ok, reason, message = False, "KedaNotInstalled", (f"autoscaling.provider keda: the API server serves no "
                                                             f"{SCALEDOBJECT.kind} ({SCALEDOBJECT.api_version}); "
                                                             "install KEDA, or use provider operator")
        elif not self.keda_prometheus_address:
            ok, reason, message = False, "KedaNotConfigured", ("autoscaling.provider keda: the operator runs "
                                                              "without --keda-prometheus-address")
        else:
            try:
                self.kube.apply(desired_scaled_object(ms, pool_name, self.keda_prometheus_address))
                ok, reason, message = True, "KedaScaledObject", (f"{SCALEDOBJECT.kind} {naming.name_of(ms)!r} "
                                                                "sets spec.replicas")
            except NameConflict as exc:
                ok, reason, message = False, exc.reason, str(exc)
        previous = (ms.get("status") or {}).get("conditions") or []
        mine = stamp([condition(SCALING_ACTIVE, ok, reason, message[:1000],
                                (ms.get("metadata") or {}).get("generation"))], previous)
        others = [c for c in previous if c.get("type") not in AUTOSCALER_CONDITIONS]
        self.kube.patch_status(ms, {"conditions": others + mine})

    def _delete_unwanted_scaled_objects(self, wanted: set[tuple[str, str]]) -> None:
        """The operator's ScaledObjects of ModelServers that no longer ask for KEDA (absent KEDA: nothing)."""
        try:
            objects = self.kube.list(SCALEDOBJECT, self.namespace, label_selector=MANAGED_SELECTOR)
        except ApiError as exc:
            if exc.status == 404:
                return
            raise
        for obj in objects:
            if naming.is_managed(obj) and naming.key_of(obj) not in wanted:
                obj.setdefault("apiVersion", SCALEDOBJECT.api_version)
                obj.setdefault("kind", SCALEDOBJECT.kind)
                self.kube.delete(obj)

    def readings(self, pool: dict) -> dict[str, EppReading]:
        """Each ready EPP pod's reading (by pod name), read once per run_once; an EPP whose page fails is left
        out (and logged)."""
        key = naming.key_of(pool)
        if key not in self._pages:
            self._pages[key] = self._read_pool(pool)

        return self._pages[key]

    def _read_pool(self, pool: dict) -> dict[str, EppReading]:
        ns = naming.namespace_of(pool)
        labels = naming.selector_labels("epp", naming.name_of(pool))
        out = {}
        for pod in self.kube.list(POD, ns, label_selector=naming.selector_string(labels)):
            meta, status = pod.get("metadata") or {}, pod.get("status") or {}
            if (any((meta.get("labels") or {}).get(k) != v for k, v in labels.items()) or naming.is_deleting(pod)
                    or not status.get("podIP")
                    or not any(c.get("type") == "Ready" and c.get("status") == "True"
                               for c in status.get("conditions") or [])):
                continue
            url = f"http://{status['podIP']}:{self.metrics_port}/metrics"
            try:
                out[meta["name"]] = parse_epp_page(self.fetch(url))
            except (ValueError, httpx.HTTPError, OSError) as exc:
                log.warning("autoscaler: EPP pod %s/%s metrics (%s): %s", ns, meta["name"], url, str(exc)[:300])
                if self.metrics is not None:
                    self.metrics.read_failed(naming.key_of(pool))
        return out

    def evaluate(self, ms: dict) -> Decision | None:
        """One look at one ModelServer: decide, record, tell. The decision, or None without its pool."""
        ns, name = naming.key_of(ms)
        spec = ms["spec"]
        pool = self.kube.get(POOL, pool_ref_name(ms) or "", ns)
        if pool is None:
            if self.metrics is not None:
                self.metrics.forget((ns, name))
            return None  # the reconciler's PoolFound condition says so
        state = self._states.setdefault((ns, name), _State())
        now = self.clock()
        recorded = (ms.get("status") or {}).get("autoscaling") or {}
        current = rendered_replicas(ms)
        last_up = _epoch(recorded.get("lastScaleUpTime"))
        if recorded and recorded.get("specReplicas") != spec_replicas(spec):
            # A user set spec.replicas: the Deployment runs it now; go on from there as after a scale-up.
            state.history, last_up = (), now
            log.info("%s: spec.replicas set to %d by a user; autoscaling goes on from %d", describe(ms),
                     spec_replicas(spec), current)
        if not state.history:
            state.history = ((now, current),)
        deployment = self.kube.get(DEPLOYMENT, naming.engine_deployment_name(ms), ns)
        ready = int(((deployment or {}).get("status") or {}).get("readyReplicas") or 0)
        readings = self.readings(pool)
        signals = pool_signals(readings, state.readings)
        state.readings = readings
        policy = policy_of(spec)
        decision = decide(policy, signals, current, min(ready, current), state.history, last_up, now)
        state.history = decision.history
        self._record(ms, decision, current, now, last_up)
        if self.metrics is not None:
            self.metrics.observe((ns, name), policy, signals, current, ready, decision)
        if decision.desired != current:
            log.info("%s: %d -> %d replicas (%s: %s)", describe(ms), current, decision.desired, decision.reason,
                     decision.message)
            self.event(ms, "Normal", decision.reason, f"{current} -> {decision.desired} replicas: {decision.message}")
            self.enqueue(("ModelServer", ns, name))
        failing = decision.reason == "FailedGetMetrics"
        if failing and not state.failing:
            self.event(ms, "Warning", "FailedGetMetrics",
                       f"no EPP pod of InferencePool {naming.name_of(pool)!r} answered its metrics page")
        state.failing = failing
        return decision

    def _record(self, ms: dict, d: Decision, current: int, now: float, last_up: float | None) -> None:
        spec = ms["spec"]
        recorded = dict((ms.get("status") or {}).get("autoscaling") or {})
        recorded.update(currentReplicas=current, desiredReplicas=d.desired, specReplicas=spec_replicas(spec))
        if d.desired != current:
            recorded["lastScaleTime"] = _rfc3339(now)
        up = now if d.desired > current else last_up  # a user's change of spec.replicas counts as one
        if up is not None:
            recorded["lastScaleUpTime"] = _rfc3339(up)
        previous = (ms.get("status") or {}).get("conditions") or []
        gen = (ms.get("metadata") or {}).get("generation")
        active = condition(SCALING_ACTIVE, d.reason != "FailedGetMetrics", d.reason, d.message[:1000], gen)
        mine = [active]
        if d.desired != current:
            mine.append(condition(SCALED, True, d.reason, f"{current} -> {d.desired} replicas: {d.message}"[:1000],
                                  gen))
        else:
            old = next((c for c in previous if c.get("type") == SCALED), None)
            if old is not None:
                mine.append(old)
        others = [c for c in previous if c.get("type") not in AUTOSCALER_CONDITIONS]
        self.kube.patch_status(ms, {"autoscaling": recorded, "conditions": others + stamp(mine, previous)})

    def event(self, ms: dict, type_: str, reason: str, message: str) -> None:
        """A core/v1 Event on `ms` (best effort: a refused event is logged, never a failed look)."""
        ns, name = naming.key_of(ms)
        stamp_now = _rfc3339(self.clock())
        event = {"apiVersion": "v1", "kind": "Event",
                 "metadata": {"generateName": f"{name}.", "namespace": ns},
                 "involvedObject": {"apiVersion": MODELSERVER.api_version, "kind": MODELSERVER.kind, "name": name,
                                    "namespace": ns, "uid": (ms.get("metadata") or {}).get("uid")},
                 "type": type_, "reason": reason, "message": message[:1000],
                 "source": {"component": "kvgate-operator"}, "reportingComponent": "kvgate.dev/operator",
                 "firstTimestamp": stamp_now, "lastTimestamp": stamp_now, "count": 1}
        try:
            self.kube.request("POST", f"/api/v1/namespaces/{ns}/events", event)
        except (ApiError, OSError) as exc:
            log.warning("autoscaler: event on %s not written: %s", describe(ms), exc)
