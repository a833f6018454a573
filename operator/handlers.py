"""The kopf layer: watch events enqueue keys; one worker reconciles them with the pure functions.

Level-triggered and idempotent. A handler never acts on the event's body: it only names what to reconcile
(a ModelServer, an InferencePool, or "the Gateways"), and the worker reads the current state from the API
server, computes the desired objects and statuses (modelserver.py, pool.py, gateway.py) and applies them.
Re-applying an unchanged object is a no-op on the server, so the loop settles. A periodic resync
(`resync_s`) enqueues everything again, which also catches anything a watch missed.

Only `@kopf.on.event` handlers: they keep no state on the objects (no kopf annotations, no finalizers), so
deleting a ModelServer, pool or Gateway is never blocked by the operator being down, and the garbage
collector removes what the operator made through the owner references on every object.

Keys (deduplicated while queued, and while waiting for a retry):
    ("ModelServer", ns, name)    the engine Deployment and the ModelServer's status
    ("InferencePool", ns, name)  the pool's EPP objects when the operator manages them: its config (re-read
                                 from the referenced ConfigMap each time), its NetworkPolicy, its status entry
    ("ConfigUsers", ns, name)    the pools whose kvgate.dev/epp-config names this ConfigMap
    ("PoolMembers", ns, name)    the ModelServers of a pool's namespace: its members' Deployments follow its
                                 selector, and no other's pods may match it (tenancy.py, JoinsOtherPool)
    ("Gateways",)                GatewayClass statuses; per Gateway of ours the Envoy objects and status;
                                 HTTPRoute and InferencePool status.parents (they need all Gateways at once)

Failures are temporary or permanent (failures.py, kopf's TemporaryError / PermanentError). A temporary one (the
API server unreachable, 409, 429, 5xx, timeouts) retries its key with exponential backoff, 1 s doubling to 60 s.
A permanent one (the API server refused the request: 400, 403, 404, 422; or the reconcile raised on its own) is
a condition on the object — the ModelServer's Ready, the pool's EPP entry, the Gateway's Programmed, reason
ReconcileFailed with the message — logged once, and not retried: the next event or resync looks again. A name
the operator wants that is taken by an object not its own (apply.py's NameConflict) is permanent until a user
acts, so it is such a condition too (reason NameConflict, naming the object).
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass

import kopf

from kvgate.envoy_config import PoolBackend
from kvgate.operator import naming
from kvgate.operator.apply import KINDS, ApiError, Kube, NameConflict, describe
from kvgate.operator.conditions import condition, stamp
from kvgate.operator.envoy_routes import WeightedBackend
from kvgate.operator.failures import REASON as FAILED, classify, is_refusal
from kvgate.operator.gateway import (GatewayRouting, desired_envoy_objects, gateway_status, gatewayclass_status,
                                     httproute_status, is_our_class, render_config, routes_for_gateway)
from kvgate.operator.modelserver import (desired_engine_deployment, modelserver_status, needs_recreate,
                                         validate_modelserver)
from kvgate.operator.network_policy import (desired_engine_network_policy, desired_network_policy,
                                            engine_policy_enabled, engine_policy_name, gateways_routing_to,
                                            policy_enabled, route_refs)
from kvgate.operator.pool import (choose_epp_config, desired_epp_objects, epp_pool_status, epp_problems, epp_ref,
                                  epp_tokenizer, is_fail_open, manages_epp, pool_status, referenced_config_name, returns_lists,
                                  running_note, without_epp_status)
from kvgate.operator.spec_shape import pool_problems, pool_ref_name
from kvgate.operator.tenancy import TenantPolicy, privileged_uses

log = logging.getLogger("kvgate.operator")

MODELSERVER = KINDS[("kvgate.dev/v1alpha1", "ModelServer")]
POOL = KINDS[("inference.networking.k8s.io/v1", "InferencePool")]
GATEWAYCLASS = KINDS[("gateway.networking.k8s.io/v1", "GatewayClass")]
GATEWAY = KINDS[("gateway.networking.k8s.io/v1", "Gateway")]
HTTPROUTE = KINDS[("gateway.networking.k8s.io/v1", "HTTPRoute")]
REFERENCEGRANT = KINDS[("gateway.networking.k8s.io/v1beta1", "ReferenceGrant")]
DEPLOYMENT = KINDS[("apps/v1", "Deployment")]
SERVICE = KINDS[("v1", "Service")]
CONFIGMAP = KINDS[("v1", "ConfigMap")]
POD = KINDS[("v1", "Pod")]
NAMESPACE = KINDS[("v1", "Namespace")]
NETWORKPOLICY = KINDS[("networking.k8s.io/v1", "NetworkPolicy")]

GATEWAYS_KEY = ("Gateways",)
# Label this on a ConfigMap named by a pool's kvgate.dev/epp-config and a change to it rolls out at once; an
# unlabelled one is picked up at the next reconcile of its pools (every resync).
CONFIG_LABEL = "kvgate.dev/epp-config"
_MANAGED_SELECTOR = f"{naming.MANAGED_BY_KEY}={naming.MANAGED_BY}"
# Filters the API server applies to kopf's watches (the handlers' label filters alone run in the operator,
# after every object of the kind was sent to it): only the operator's own objects and labelled ConfigMaps.
SERVER_SIDE_SELECTORS = {
    ("apps", "v1", "deployments"): _MANAGED_SELECTOR,
    ("", "v1", "services"): _MANAGED_SELECTOR,
    ("networking.k8s.io", "v1", "networkpolicies"): _MANAGED_SELECTOR,
    ("", "v1", "configmaps"): CONFIG_LABEL,
}
EPP_ADDRESS_MODES = ("service", "pod-ip")


@dataclass
class OperatorConfig:
    engine_image: str
    epp_image: str
    envoy_image: str
    namespace: str | None = None  # None: all namespaces
    # "service": Envoy reaches a pool's EPP by its Service's DNS name (any cluster with Service routing).
    # "pod-ip": by the IP of a ready EPP pod (clusters without Service routing, e.g. the e2e rig).
    epp_address_mode: str = "service"
    envoy_service_type: str = "ClusterIP"
    resync_s: float = 15.0
    # A NetworkPolicy per managed pool's EPP (network_policy.py); the peers that may scrape every EPP's metrics.
    network_policy: bool = True
    epp_metrics_from: tuple = ()
    # What ModelServers may use beyond the default (tenancy.py): --allow-host-path, --allow-image-prefix.
    tenant_policy: TenantPolicy = TenantPolicy()


# --- the work queue ------------------------------------------------------------------------------------------

class WorkQueue:
    """Keys to reconcile: deduplicated while waiting, delayed retries kept in a heap (at most one per key: the
    earliest), one consumer."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._ready: list[tuple] = []
        self._queued: set[tuple] = set()
        self._delayed: list[tuple[float, tuple]] = []
        self._due: dict[tuple, float] = {}  # key -> when its one pending retry is due; heap entries not here are stale
        self._stopped = False

    def add(self, key: tuple, delay_s: float = 0.0) -> None:
        with self._cond:
            if delay_s > 0:
                due = time.monotonic() + delay_s
                if self._due.get(key, float("inf")) <= due:
                    return  # a retry is already due sooner
                self._due[key] = due
                heapq.heappush(self._delayed, (due, key))
            elif key not in self._queued:
                self._queued.add(key)
                self._ready.append(key)
            self._cond.notify()

    def pending_retries(self) -> dict[tuple, float]:
        """Keys waiting for a retry, and in how many seconds it is due."""
        with self._cond:
            now = time.monotonic()
            return {key: due - now for key, due in self._due.items()}

    def get(self) -> tuple | None:
        """The next key (None once stopped); waits for one."""
        with self._cond:
            while not self._stopped:
                now = time.monotonic()
                while self._delayed and self._delayed[0][0] <= now:
                    due, key = heapq.heappop(self._delayed)
                    if self._due.get(key) != due:
                        continue  # replaced by an earlier retry
                    del self._due[key]
                    if key not in self._queued:
                        self._queued.add(key)
                        self._ready.append(key)
                if self._ready:
                    key = self._ready.pop(0)
                    self._queued.discard(key)
                    return key
                timeout = (self._delayed[0][0] - now) if self._delayed else None
                self._cond.wait(timeout)
            return None

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()


# --- reconciling ---------------------------------------------------------------------------------------------

def _deleting(obj: dict | None) -> bool:
    return bool(obj) and bool((obj.get("metadata") or {}).get("deletionTimestamp"))


def _ours(entries: list[dict] | None) -> bool:
    return any(e.get("controllerName") == naming.CONTROLLER_NAME for e in entries or [])


def _ready_pods(pods: list[dict], selector: dict[str, str]) -> list[dict]:
    def ready(p):
        return any(c.get("type") == "Ready" and c.get("status") == "True"
                   for c in (p.get("status") or {}).get("conditions") or [])
    return sorted((p for p in pods if selector and not _deleting(p) and (p.get("status") or {}).get("podIP")
                   and ready(p) and all(((p.get("metadata") or {}).get("labels") or {}).get(k) == v
                                        for k, v in selector.items())), key=naming.name_of)


def _target_port(service: dict, port: int, pod: dict) -> int | None:
    """The pod port behind `service`'s port `port` (a named targetPort looked up in the pod's containers)."""
    for sp in (service.get("spec") or {}).get("ports") or []:
        if sp.get("port") != port:
            continue
        target = sp.get("targetPort", port)
        if isinstance(target, int):
            return target
        if str(target).isdigit():
            return int(target)
        for c in (pod.get("spec") or {}).get("containers") or []:
            for cp in c.get("ports") or []:
                if cp.get("name") == target:
                    return int(cp["containerPort"])
    return None


def epp_backend_via_pod(backend: PoolBackend, service: dict | None, pods: list[dict]) -> PoolBackend:
    """`backend` reaching its EPP by the IPs and target ports of every ready pod behind the EPP's Service
    (epp-address-mode pod-ip), none while none is ready; unchanged (the Service's DNS name) without the Service.

    All of them, not one: during an EPP rollout the new pod joins once Ready (Envoy sends it streams once its
    own health check passes) and the old one leaves once deleted (Envoy keeps it while its health check passes:
    the old EPP's lame duck), and the cluster itself never changes (envoy_config.pool_clusters)."""
    if not service:
        return backend
    hosts = []
    for pod in _ready_pods(pods, (service.get("spec") or {}).get("selector") or {}):
        port = _target_port(service, backend.epp_port, pod)
        if port is None:
            continue
        health = _target_port(service, backend.epp_health_port, pod) if backend.epp_health_port else None
        hosts.append((pod["status"]["podIP"], port, health or backend.epp_health_port))
    return dataclasses.replace(backend, epp_pods=tuple(hosts))


class Reconciler:
    def __init__(self, kube: Kube, config: OperatorConfig) -> None:
        self.kube, self.config = kube, config
        self.queue = WorkQueue()
        self._failures: dict[tuple, int] = defaultdict(int)
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._uses_logged: dict[tuple[str, str], tuple] = {}  # ModelServer -> (generation, uses) last logged
        self._permanent_logged: dict[tuple, str] = {}  # ("key", *key) or an object -> its permanent failure logged

    # --- lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> None:
        for target, name in ((self._work, "reconcile"), (self._resync, "resync")):
            t = threading.Thread(target=target, name=f"kvgate-operator-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        self.queue.stop()
        for t in self._threads:
            t.join(timeout=10)

    @property
    def stopped(self) -> threading.Event:
        """Set once stop() ran: kopf's cleanup, when its reactor ends (see main.run_reactor)."""
        return self._stop

    def _work(self) -> None:
        while (key := self.queue.get()) is not None:
            self.process(key)

    def process(self, key: tuple) -> float | None:
        """Reconcile `key`, never raising: a temporary failure queues a retry (its delay is returned), a
        permanent one is logged once and not retried (None, as for a success)."""
        try:
            self.reconcile(key)
        except Exception as exc:
            failure = classify(exc)
            if isinstance(failure, kopf.PermanentError):  # not an object's (those are conditions): a list, say
                self._failures.pop(key, None)
                self._log_permanent(key, failure, memo=("key", *key))
                return None
            self._failures[key] += 1
            delay = failure.delay if failure.delay is not None else min(60.0, 2.0 ** (self._failures[key] - 1))
            log.warning("reconcile %s failed (attempt %d), retrying in %.0fs: %s", "/".join(key),
                        self._failures[key], delay, failure)
            self.queue.add(key, delay)
            return delay
        self._failures.pop(key, None)
        self._permanent_logged.pop(("key", *key), None)
        return None

    def _log_permanent(self, key: tuple, failure: kopf.PermanentError, memo: tuple | None = None) -> None:
        """Once per key (or object: `memo`) and message, as a resync meets it again: a refusal by the API server
        as a line, anything else with its traceback."""
        memo = memo or key
        if self._permanent_logged.get(memo) == str(failure):
            return
        self._permanent_logged[memo] = str(failure)
        log.error("reconcile %s failed permanently, not retrying (the next change or resync looks again): %s",
                  "/".join(key), failure, exc_info=None if is_refusal(failure) else (failure.__cause__ or failure))

    def _guarded(self, kind: str, ns: str, name: str) -> None:
        """Reconcile one ModelServer or InferencePool; a permanent failure becomes its ReconcileFailed condition
        (temporary ones propagate: the key is retried)."""
        try:
            (self.reconcile_modelserver if kind == "ModelServer" else self.reconcile_pool)(ns, name)
        except Exception as exc:
            failure = classify(exc)
            if isinstance(failure, kopf.TemporaryError):
                raise failure from exc
            self._log_permanent((kind, ns, name), failure)
            self._report_failure(kind, ns, name, failure)
        else:
            self._permanent_logged.pop((kind, ns, name), None)

    def _report_failure(self, kind: str, ns: str, name: str, failure: kopf.PermanentError) -> None:
        message = f"the operator cannot reconcile it: {failure}"[:1000]
        if kind == "ModelServer":
            obj = self.kube.get(MODELSERVER, name, ns)
            if obj is None:
                return
            previous = (obj.get("status") or {}).get("conditions") or []
            failed = condition("Ready", False, FAILED, message, (obj.get("metadata") or {}).get("generation"))
            status = {"conditions": stamp([failed], previous) + [c for c in previous if c.get("type") != "Ready"]}
        else:
            obj = self.kube.get(POOL, name, ns)
            if obj is None:
                return
            status = epp_pool_status(obj, [{"reason": FAILED, "message": message}],
                                     "The EPP keeps running what it ran.")
        self.kube.patch_status(obj, status)

    def _resync(self) -> None:
        while not self._stop.wait(self.config.resync_s):
            try:
                self.enqueue_all()
            except Exception as exc:
                log.warning("resync: listing failed: %s", exc)

    def enqueue_all(self) -> None:
        ns = self.config.namespace
        for ms in self.kube.list(MODELSERVER, ns):
            self.queue.add(("ModelServer", *naming.key_of(ms)))
        for pool in self.kube.list(POOL, ns):
            self.queue.add(("InferencePool", *naming.key_of(pool)))
        self.queue.add(GATEWAYS_KEY)

    def reconcile(self, key: tuple) -> None:
        kind = key[0]
        if kind in ("ModelServer", "InferencePool"):
            self._guarded(kind, key[1], key[2])
        elif kind == "PoolMembers":  # every ModelServer of the namespace: a new selector may match any
            for ms in self.kube.list(MODELSERVER, key[1]):
                self._guarded("ModelServer", *naming.key_of(ms))
        elif kind == "ConfigUsers":
            for pool in self.kube.list(POOL, key[1]):
                if referenced_config_name(pool) == key[2]:
                    self._guarded("InferencePool", *naming.key_of(pool))
        elif kind == "Gateways":
            self.reconcile_gateways()
        else:
            raise ValueError(f"unknown key {key}")

    # --- ModelServer ----------------------------------------------------------------------------------------
    def reconcile_modelserver(self, ns: str, name: str) -> None:
        ms = self.kube.get(MODELSERVER, name, ns)
        if ms is None or _deleting(ms):
            return
        pool_name = pool_ref_name(ms)
        pools = [p for p in self.kube.list(POOL, ns) if not _deleting(p)]  # its pool, and the others' selectors
        pool = next((p for p in pools if naming.name_of(p) == pool_name), None)
        policy, image = self.config.tenant_policy, self.config.engine_image
        problems = validate_modelserver(ms, pool, policy, pools, image)
        desired = None if problems else desired_engine_deployment(ms, pool, image, policy, pools)
        existing = self.kube.get(DEPLOYMENT, naming.engine_deployment_name(ms), ns)
        blocker = None
        if desired is None:
            if existing is not None and naming.takeover_refusal(existing, _deployment_of(ms)):
                existing = None  # someone else's: its counts are not this ModelServer's
        elif (why := naming.takeover_refusal(existing, desired)) is not None:
            # Checked here too (apply checks again) because the recreate below deletes.
            blocker = condition("Ready", False, NameConflict.reason, str(NameConflict(desired, why)))
            existing = None
        else:
            self._log_privileged_uses(ms)
            if needs_recreate(existing, desired):
                log.info("%s: the pool's selector changed; recreating its Deployment", describe(ms))
                self.kube.delete(existing)
            try:
                existing = self.kube.apply(desired)
            except NameConflict as exc:  # created by someone else since the read above
                blocker, existing = condition("Ready", False, exc.reason, str(exc)), None
            except ApiError as exc:
                if exc.status not in (400, 422):
                    raise
                blocker = condition("Ready", False, "DeploymentRejected", str(exc)[:1000])
        status = modelserver_status(ms, existing, pool, problems=problems)
        if blocker is not None:
            blocker["observedGeneration"] = (ms.get("metadata") or {}).get("generation")
            others = [c for c in status["conditions"] if c["type"] != "Ready"]
            status["conditions"] = stamp([blocker], (ms.get("status") or {}).get("conditions")) + others
        self.kube.patch_status(ms, status)

    def _log_privileged_uses(self, ms: dict) -> None:
        """Log what an allowed ModelServer uses beyond the default (hostPath, another image): once per
        generation, so that each use is on record without a line every resync."""
        uses = privileged_uses(ms, self.config.engine_image)
        key = naming.key_of(ms)
        seen = ((ms.get("metadata") or {}).get("generation"), tuple(uses))
        if uses and self._uses_logged.get(key) != seen:
            log.warning("%s uses %s (allowed by the operator's flags)", describe(ms), ", ".join(uses))
        self._uses_logged[key] = seen

    # --- InferencePool: the EPP -----------------------------------------------------------------------------
    def reconcile_pool(self, ns: str, name: str) -> None:
        pool = self.kube.get(POOL, name, ns)
        if pool is None or _deleting(pool):
            return
        ref = epp_ref(pool)
        service = self.kube.get(SERVICE, ref["name"], ns) if isinstance(ref.get("name"), str) else None
        modelservers = self.kube.list(MODELSERVER, ns)
        if not manages_epp(pool, service, modelservers):
            if (status := without_epp_status(pool)) is not None:  # no longer ours: drop our status entry
                self.kube.patch_status(pool, status)
            return
        # The config is re-read from its ConfigMap at each reconcile (every resync at the latest); a ConfigMap
        # labelled kvgate.dev/epp-config also wakes its pools at once (the label-selected watch in register).
        config_name = referenced_config_name(pool)
        choice = choose_epp_config(pool, self.kube.get(CONFIGMAP, config_name, ns) if config_name else None,
                                   self.kube.get(CONFIGMAP, naming.epp_name(pool), ns), modelservers)
        problems = epp_problems(pool, None) + ([choice.problem] if choice.problem else [])
        if problems and problems[0]["reason"] == "InvalidSpec":  # nothing can be rendered from it
            problems = problems[:1]
        elif self.config.network_policy:  # before the EPP's pods: they never run unprotected
            problems += self._network_policy(pool) + self._engine_network_policy(pool, modelservers)
        tokenizer = epp_tokenizer(choice.config_yaml, pool, modelservers)
        if tokenizer.problem:  # the EPP still runs (it routes without the precise scorer's hits); the status says why
            problems.append(tokenizer.problem)
        objects = desired_epp_objects(pool, self.config.epp_image, choice.config_yaml,
                                      behind_service=self.config.epp_address_mode == "service", tokenizer=tokenizer) \
            if choice.config_yaml is not None and not _conflicts(problems) else []
        for obj in objects:  # in order; a name taken by someone else stops the rest (the EPP needs them all)
            try:
                self.kube.apply(obj)
            except NameConflict as exc:
                problems.append({"reason": exc.reason, "message": str(exc)})
                break
        status = epp_pool_status(pool, problems, running_note(choice, bool(objects)))
        if problems and status["parents"] != (pool.get("status") or {}).get("parents"):  # once, not every resync
            log.warning("%s: %s", describe(pool), "; ".join(p["message"] for p in problems))
        self.kube.patch_status(pool, status)

    def _network_policy(self, pool: dict) -> list[dict]:
        """Apply (or, for an opted-out pool, delete) the EPP's NetworkPolicy; its problems."""
        ns = naming.namespace_of(pool)
        if not policy_enabled(pool):
            existing = self.kube.get(NETWORKPOLICY, naming.epp_name(pool), ns)
            if naming.is_managed(existing) and naming.is_owned_by(existing, pool):
                self.kube.delete(existing)
            return []
        using = self._gateways_using(pool)
        policy, problems = desired_network_policy(pool, using, self.config.epp_metrics_from)
        try:
            self.kube.apply(policy)
        except NameConflict as exc:  # no EPP pods then: they would run without their policy
            return problems + [{"reason": exc.reason, "message": str(exc)}]
        except ApiError as exc:
            if exc.status not in (400, 422):
                raise
            # The API server refused a peer of the pool's annotations: the policy without them (the Gateways'
            # and the operator's peers only) still protects the EPP; the status says what was refused.
            self.kube.apply(desired_network_policy(pool, using, self.config.epp_metrics_from,
                                                   trust_annotations=False)[0])
            problems.append({"reason": "NetworkPolicyRejected",
                             "message": f"the NetworkPolicy with the pool's peer annotations was refused: {exc}"})
        return problems

    def _gateways_using(self, pool: dict) -> list[dict]:
        """The operator's Gateways whose HTTPRoutes send traffic to `pool` (network_policy.gateways_routing_to)."""
        ns, scope = naming.namespace_of(pool), self.config.namespace
        classes = {naming.name_of(gc) for gc in self.kube.list(GATEWAYCLASS) if is_our_class(gc)}
        gateways = [g for g in self.kube.list(GATEWAY, scope)
                    if (g.get("spec") or {}).get("gatewayClassName") in classes and not _deleting(g)]
        routes = self.kube.list(HTTPROUTE, scope)
        grants = self.kube.list(REFERENCEGRANT, ns) if any(
            naming.namespace_of(r) != ns for r in routes) else []
        return gateways_routing_to(pool, routes, gateways, grants)

    def _engine_network_policy(self, pool: dict, modelservers: list[dict]) -> list[dict]:
        """Apply (or, for an opted-out pool, delete) the NetworkPolicy of the pool's engine pods (its HTTP port
        from the Gateways and the EPP, its KV-event ports from the EPP only); its problems."""
        using = self._gateways_using(pool) if engine_policy_enabled(pool) else []
        policy, problems = desired_engine_network_policy(pool, using, modelservers) \
            if engine_policy_enabled(pool) else (None, [])
        if policy is None:  # opted out, or a pool that selects no pods by labels
            existing = self.kube.get(NETWORKPOLICY, engine_policy_name(pool), naming.namespace_of(pool))
            if naming.is_managed(existing) and naming.is_owned_by(existing, pool):
                self.kube.delete(existing)
            return problems
        try:
            self.kube.apply(policy)
        except NameConflict as exc:
            return problems + [{"reason": exc.reason, "message": str(exc)}]
        except ApiError as exc:
            if exc.status not in (400, 422):
                raise
            self.kube.apply(desired_engine_network_policy(pool, using, modelservers, trust_annotations=False)[0])
            problems.append({"reason": "NetworkPolicyRejected", "message": "the engines' NetworkPolicy with the "
                                                                          f"pool's peer annotations was refused: {exc}"})
        return problems

    # --- Gateways, routes, pool parents ---------------------------------------------------------------------
    def reconcile_gateways(self) -> None:
        ns = self.config.namespace
        classes = [gc for gc in self.kube.list(GATEWAYCLASS) if is_our_class(gc) and not _deleting(gc)]
        for gc in classes:
            self.kube.patch_status(gc, gatewayclass_status(gc))
        class_names = {naming.name_of(gc) for gc in classes}
        gateways = [g for g in self.kube.list(GATEWAY, ns)
                    if (g.get("spec") or {}).get("gatewayClassName") in class_names and not _deleting(g)]
        routes = self.kube.list(HTTPROUTE, ns)
        pools = [p for p in self.kube.list(POOL, ns) if not pool_problems(p)]  # a misshapen one: as if absent
        services = self.kube.list(SERVICE, ns)
        grants = self.kube.list(REFERENCEGRANT, ns)
        namespaces = self._namespace_labels()
        pods = _PodCache(self.kube)
        # Pools whose EPP (the operator's) answers with lists get override_host routes retrying over the list.
        epp_configs = {naming.key_of(cm): cm for cm in self.kube.list(
            CONFIGMAP, ns, label_selector=f"app.kubernetes.io/component=epp,{naming.MANAGED_BY_KEY}={naming.MANAGED_BY}")}
        fallback_pools = frozenset(naming.key_of(pool) for pool in pools if returns_lists(
            epp_configs.get((naming.namespace_of(pool), naming.epp_name(pool))), pool))
        endpoints = {}
        for pool in pools:  # FailOpen's cluster, and an override_host cluster's hosts (other pools use none)
            if is_fail_open(pool) or naming.key_of(pool) in fallback_pools:
                from kvgate.epp.datastore import pool_endpoints

                endpoints[naming.key_of(pool)] = [e.address for e in pool_endpoints(pool, pods.of(naming.namespace_of(pool)))]

        route_parents: dict[tuple[str, str], list[dict]] = defaultdict(list)
        pool_gateways: dict[tuple[str, str], list[dict]] = defaultdict(list)
        failed = []
        for gw in gateways:
            routing = GatewayRouting([], {}, [], {})  # what the status shows if the routes cannot be computed
            try:
                routing = routes_for_gateway(gw, routes, pools, services, grants, endpoints, namespaces,
                                             fallback_pools)
                if self.config.epp_address_mode == "pod-ip":
                    routing = self._epp_via_pods(routing, services, pods)
                previous = self.kube.get(CONFIGMAP, naming.envoy_name(gw), naming.namespace_of(gw))
                applied = [self.kube.apply(o) for o in
                           desired_envoy_objects(gw, render_config(gw, routing), self.config.envoy_image,
                                                 self.config.envoy_service_type,
                                                 previous if naming.is_owned_by(previous, gw) else None)]
                deployment = next(o for o in applied if o.get("kind") == "Deployment")
                service = next(o for o in applied if o.get("kind") == "Service")
                self.kube.patch_status(gw, gateway_status(gw, deployment, service, routing))
            except NameConflict as exc:  # permanent until the user acts: a condition, no retry loop
                log.warning("%s: %s", describe(gw), exc)
                self.kube.patch_status(gw, _not_programmed(gateway_status(gw, None, None, routing), gw, exc))
                continue
            except Exception as exc:
                failure = classify(exc)
                if isinstance(failure, kopf.TemporaryError):  # the other Gateways go on; then the key is retried
                    failed.append(f"{describe(gw)}: {failure}")
                    log.warning("%s: reconcile failed: %s", describe(gw), failure)
                    continue
                self._log_permanent(("Gateway", *naming.key_of(gw)), failure)
                self.kube.patch_status(gw, _not_programmed(gateway_status(gw, None, None, routing), gw, failure))
                continue
            self._permanent_logged.pop(("Gateway", *naming.key_of(gw)), None)
            for key, entries in routing.route_parents.items():
                route_parents[key] += entries
            for key in routing.pools_used:
                pool_gateways[key].append(gw)

        for route in routes:
            ours = route_parents.get(naming.key_of(route), [])
            if ours or _ours((route.get("status") or {}).get("parents")):
                self.kube.patch_status(route, httproute_status(route, ours))
        svc_by_key = {naming.key_of(s): s for s in services}
        for pool in pools:
            using = pool_gateways.get(naming.key_of(pool), [])
            if using or _ours((pool.get("status") or {}).get("parents")):
                svc = svc_by_key.get((naming.namespace_of(pool), epp_ref(pool).get("name", "")))
                self.kube.patch_status(pool, pool_status(pool, using, svc))
        if failed:
            raise kopf.TemporaryError("; ".join(failed), delay=None)

    def _namespace_labels(self) -> dict[str, dict]:
        try:
            return {naming.name_of(n): (n.get("metadata") or {}).get("labels") or {} for n in self.kube.list(NAMESPACE)}
        except ApiError as exc:
            if exc.status != 403:  # a namespaced operator may not read namespaces: selectors then match none
                raise
            return {}

    def _epp_via_pods(self, routing: GatewayRouting, services: list[dict], pods: "_PodCache") -> GatewayRouting:
        svc_by_key = {naming.key_of(s): s for s in services}
        swapped: dict[str, PoolBackend] = {}

        def swap(backend):
            if not isinstance(backend, PoolBackend):
                return backend
            if backend.name not in swapped:
                # PoolBackend.name is "<namespace>-<pool>" and epp_host "<service>.<namespace>.svc..."
                svc_name, _, rest = backend.epp_host.partition(".")
                svc_ns = rest.split(".", 1)[0]
                swapped[backend.name] = epp_backend_via_pod(backend, svc_by_key.get((svc_ns, svc_name)),
                                                            pods.of(svc_ns))
            return swapped[backend.name]

        rules = [dataclasses.replace(r, backends=[WeightedBackend(swap(w.backend), w.weight) for w in r.backends])
                 for r in routing.rules]
        return routing._replace(rules=rules)


def _conflicts(problems: list[dict]) -> bool:
    return any(p["reason"] == NameConflict.reason for p in problems)


def _deployment_of(ms: dict) -> dict:
    """The identity (kind, name, owner) of a ModelServer's engine Deployment, for ownership checks."""
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": naming.object_meta(naming.engine_deployment_name(ms), ms, {})}


def _not_programmed(status: dict, gateway: dict, exc: Exception) -> dict:
    """A Gateway status whose Programmed condition says why its objects are not (all) applied: which of their
    names is taken (NameConflict), or the permanent failure (ReconcileFailed)."""
    gen = (gateway.get("metadata") or {}).get("generation")
    reason = exc.reason if isinstance(exc, NameConflict) else FAILED
    message = str(exc) if isinstance(exc, NameConflict) else f"the operator cannot reconcile it: {exc}"[:1000]
    programmed = condition("Programmed", False, reason, message, gen)
    conds = [c for c in status["conditions"] if c["type"] != "Programmed"]
    return {**status, "conditions": conds + stamp([programmed], (gateway.get("status") or {}).get("conditions"))}


class _PodCache:
    """Pods per namespace, listed at most once per reconcile."""

    def __init__(self, kube: Kube) -> None:
        self.kube, self._by_ns = kube, {}

    def of(self, ns: str) -> list[dict]:
        if ns not in self._by_ns:
            self._by_ns[ns] = self.kube.list(POD, ns)
        return self._by_ns[ns]


# --- kopf registration ---------------------------------------------------------------------------------------

class RouteIndex:
    """What each HTTPRoute referenced when last seen: the pools and Gateways of its refs. A route event then
    wakes the pools it references and the ones it stopped referencing (their NetworkPolicies follow), and a
    Gateway event the pools behind that Gateway's routes. Only keys, a few per route."""

    def __init__(self) -> None:
        self._refs: dict[tuple[str, str], tuple[set, set]] = {}
        self._lock = threading.Lock()

    def update(self, key: tuple[str, str], route: dict | None) -> set[tuple[str, str]]:
        """Record `route` (None: deleted); the pools it references now or did before."""
        with self._lock:
            before = self._refs.pop(key, (set(), set()))[0]
            if route is None:
                return before
            self._refs[key] = route_refs(route)
            return before | self._refs[key][0]

    def pools_behind(self, gateway_key: tuple[str, str]) -> set[tuple[str, str]]:
        with self._lock:
            return {pool for pools, gateways in self._refs.values() if gateway_key in gateways for pool in pools}


def _owner_kinds(body) -> list[str]:
    return [ref.get("kind", "") for ref in (body.get("metadata") or {}).get("ownerReferences") or []]


def register(registry, reconciler: Reconciler):
    """Register the watch handlers on a kopf OperatorRegistry; each only enqueues keys."""
    import kopf

    q = reconciler.queue
    managed = {naming.MANAGED_BY_KEY: naming.MANAGED_BY}
    routes = RouteIndex()

    @kopf.on.event("kvgate.dev", "v1alpha1", "modelservers", registry=registry)
    def modelserver_event(body, namespace, name, **_):
        q.add(("ModelServer", namespace, name))
        pool_name = pool_ref_name(body)
        if pool_name:
            q.add(("InferencePool", namespace, pool_name))

    @kopf.on.event("inference.networking.k8s.io", "v1", "inferencepools", registry=registry)
    def pool_event(namespace, name, **_):
        q.add(("InferencePool", namespace, name))
        q.add(("PoolMembers", namespace, name))
        q.add(GATEWAYS_KEY)

    @kopf.on.event("gateway.networking.k8s.io", "v1", "httproutes", registry=registry)
    def httproute_event(event, body, namespace, name, **_):
        q.add(GATEWAYS_KEY)
        for pool_key in routes.update((namespace, name), None if event.get("type") == "DELETED" else body):
            q.add(("InferencePool", *pool_key))  # the EPP's NetworkPolicy admits the route's Gateways

    @kopf.on.event("gateway.networking.k8s.io", "v1", "gateways", registry=registry)
    def gateway_event(namespace, name, **_):
        q.add(GATEWAYS_KEY)
        for pool_key in routes.pools_behind((namespace, name)):
            q.add(("InferencePool", *pool_key))

    for group, version, plural in (("gateway.networking.k8s.io", "v1", "gatewayclasses"),
                                   ("gateway.networking.k8s.io", "v1beta1", "referencegrants")):
        @kopf.on.event(group, version, plural, registry=registry, id=f"{plural}_event")
        def gateway_api_event(**_):
            q.add(GATEWAYS_KEY)

    def owned_event(body, namespace, **_):
        for ref in (body.get("metadata") or {}).get("ownerReferences") or []:
            if ref.get("kind") == "ModelServer":
                q.add(("ModelServer", namespace, ref.get("name")))
                q.add(GATEWAYS_KEY)  # FailOpen (and override_host) clusters' endpoints follow the engine pods
            elif ref.get("kind") == "InferencePool":
                q.add(("InferencePool", namespace, ref.get("name")))  # put back what a user deleted
                q.add(GATEWAYS_KEY)  # the pool's ResolvedRefs; with pod-ip, the EPP's address
            elif ref.get("kind") == "Gateway":
                q.add(GATEWAYS_KEY)

    kopf.on.event("apps", "v1", "deployments", labels=managed, registry=registry, id="deployments_event")(owned_event)
    kopf.on.event(group="", version="v1", plural="services", labels=managed, registry=registry, id="services_event")(owned_event)
    if reconciler.config.network_policy:
        kopf.on.event("networking.k8s.io", "v1", "networkpolicies", labels=managed, registry=registry,
                      id="networkpolicies_event")(owned_event)

    @kopf.on.event(group="", version="v1", plural="configmaps", labels={CONFIG_LABEL: kopf.PRESENT},
                   registry=registry, id="configmaps_event")
    def config_event(namespace, name, **_):
        q.add(("ConfigUsers", namespace, name))

    @kopf.on.login(registry=registry)
    def login(**kwargs):  # a registry of our own gets no default login handler: use the kubernetes client's
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(registry=registry)
    def startup(settings: kopf.OperatorSettings, **_):
        settings.posting.level = logging.WARNING  # Kubernetes Events only for problems
        for resource, selector in SERVER_SIDE_SELECTORS.items():
            settings.watching.label_selectors[resource] = selector
        settings.watching.server_timeout = 300  # re-list now and then, as a belt to the resync's braces
        settings.watching.client_timeout = 330
        reconciler.start()
        reconciler.queue.add(GATEWAYS_KEY)
        log.info("kvgate operator started: namespace %s, epp-address-mode %s, resync every %.0fs",
                 reconciler.config.namespace or "(all)", reconciler.config.epp_address_mode,
                 reconciler.config.resync_s)

    @kopf.on.cleanup(registry=registry)
    def cleanup(**_):
        reconciler.stop()
        log.info("kvgate operator stopped")

    return registry
