"""The operator's core: one worker takes keys off the work queue and hands each to the reconciler of its kind.

Level-triggered and idempotent. A watch event never carries what to do (watches.py only names what to
reconcile); the reconcilers read the current state from the API server, compute the desired objects and statuses
(modelserver.py, pool.py, gateway.py) and apply them. Re-applying an unchanged object is a no-op on the server, so
the loop settles. A periodic resync (`resync_s`) enqueues everything again, which also catches anything a watch
missed.

Keys (deduplicated while queued, and while waiting for a retry):
    ("ModelServer", ns, name)    the engine Deployment and the ModelServer's status (modelserver_reconciler.py)
    ("InferencePool", ns, name)  the pool's EPP objects when the operator manages them: its config (re-read
                                 from the referenced ConfigMap each time), its NetworkPolicies, its status entry
                                 (inferencepool_reconciler.py)
    ("ConfigUsers", ns, name)    the pools whose kvgate.dev/epp-config names this ConfigMap
    ("PoolMembers", ns, name)    the ModelServers of a pool's namespace: its members' Deployments follow its
                                 selector, and no other's pods may match it (tenancy.py, JoinsOtherPool)
    ("All",)                     every key above again: what a replica does first when it starts to lead
    ("Gateways",)                GatewayClass statuses; per Gateway of ours the Envoy objects and status;
                                 HTTPRoute and InferencePool status.parents (they need all Gateways at once:
                                 gateway_reconciler.py)

Failures are temporary or permanent (failures.py, kopf's TemporaryError / PermanentError). A temporary one (the
API server unreachable, 409, 429, 5xx, timeouts) retries its key with exponential backoff, 1 s doubling to 60 s
(workqueue.py). A permanent one (the API server refused the request: 400, 403, 404, 422; or the reconcile raised
on its own) is a condition on the object — the ModelServer's Ready, the pool's EPP entry, the Gateway's
Programmed, reason ReconcileFailed with the message — logged once, and not retried: the next event or resync
looks again. A name the operator wants that is taken by an object not its own (apply.py's NameConflict) is
permanent until a user acts, so it is such a condition too (reason NameConflict, naming the object).

With leader election (operator/leadership.py) only the leading replica's worker takes keys; a standby's watches
keep adding them (deduplicated), and its worker waits. Writes are fenced (fencing.py): one refused because the
Lease was lost mid-reconcile (NotLeader) puts the key back, without backoff, for when this replica leads again
(or in STANDBY_POLL_S, should the Lease be renewed after all).
"""

from __future__ import annotations

import logging
import threading

import kopf

from kvgate.operator import naming
from kvgate.operator.apply import MODELSERVER, POOL, Kube
from kvgate.operator.autoscale_metrics import AutoscaleMetrics
from kvgate.operator.autoscaler import Autoscaler
from kvgate.operator.config import OperatorConfig
from kvgate.operator.failures import PermanentFailureLog, classify
from kvgate.operator.fencing import NotLeader
from kvgate.operator.gateway_reconciler import GatewayReconciler
from kvgate.operator.inferencepool_reconciler import InferencePoolReconciler
from kvgate.operator.modelserver_reconciler import ModelServerReconciler
from kvgate.operator.pool import referenced_config_name
from kvgate.operator.workqueue import WorkQueue

log = logging.getLogger("kvgate.operator")

GATEWAYS_KEY = ("Gateways",)
ALL_KEY = ("All",)
STANDBY_POLL_S = 0.5  # how often a standby's worker, holding a key, looks whether it leads now


class Reconciler:
    """The work queue, its worker and the resync, over one reconciler per kind (modelservers, pools, gateways)."""

    def __init__(self, kube: Kube, config: OperatorConfig, autoscale_metrics: AutoscaleMetrics | None = None) -> None:
        self.kube, self.config = kube, config
        self.queue = WorkQueue()
        self.failure_log = PermanentFailureLog()
        self.modelservers = ModelServerReconciler(kube, config)
        self.pools = InferencePoolReconciler(kube, config)
        self.gateways = GatewayReconciler(kube, config, self.failure_log)
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self.leading = threading.Event()  # the worker reconciles only while set: always, without leader election
        self.leading.set()
        # Autoscaled ModelServers: the autoscaler records a count, their reconcile renders it (on the leader only).
        self.autoscaler = Autoscaler(kube, config.namespace, self.queue.add, config.autoscale_interval_s,
                                     keda_prometheus_address=config.keda_prometheus_address, leading=self.leading,
                                     metrics=autoscale_metrics)

    # --- lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> None:
        for target, name in ((self._work, "reconcile"), (self._resync, "resync")):
            t = threading.Thread(target=target, name=f"kvgate-operator-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        self.autoscaler.start()

    def stop(self) -> None:
        self._stop.set()
        self.autoscaler.stop()
        self.queue.stop()
        for t in self._threads:
            t.join(timeout=10)

    def set_leading(self, leading: bool) -> None:
        """Lead (reconcile everything again, then follow the queue) or stand by (the worker waits)."""
        if leading and not self.leading.is_set():
            self.leading.set()
            self.queue.add(ALL_KEY)
        elif not leading:
            self.leading.clear()
            self.autoscaler.stand_by()

    @property
    def stopped(self) -> threading.Event:
        """Set once stop() ran: kopf's cleanup, when its reactor ends (see main.run_reactor)."""
        return self._stop

    def _work(self) -> None:
        while (key := self.queue.get()) is not None:
            while not self.leading.is_set():  # a standby: the key waits until this replica leads
                if self._stop.wait(STANDBY_POLL_S):
                    return
            self.process(key)

    def _resync(self) -> None:
        while not self._stop.wait(self.config.resync_s):
            if not self.leading.is_set():
                continue
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

    # --- one key ----------------------------------------------------------------------------------------------
    def process(self, key: tuple) -> float | None:
        """Reconcile `key`, never raising: a temporary failure queues a retry (its delay is returned), a
        permanent one is logged once and not retried (None, as for a success)."""
        try:
            self.reconcile(key)
        except NotLeader as exc:  # the Lease was lost mid-reconcile: the leader now in office finishes it
            log.info("reconcile %s stopped: %s", "/".join(key), exc)
            self.queue.add(key, STANDBY_POLL_S)  # not at once: the election may not have seen the loss yet
            return STANDBY_POLL_S
        except Exception as exc:
            failure = classify(exc)
            if isinstance(failure, kopf.PermanentError):  # not an object's (those are conditions): a list, say
                self.queue.forget(key)
                self.failure_log.log(key, failure, memo=("key", *key))
                return None
            delay, attempt = self.queue.retry(key, failure.delay)
            log.warning("reconcile %s failed (attempt %d), retrying in %.0fs: %s", "/".join(key), attempt, delay,
                        failure)
            return delay
        self.queue.forget(key)
        self.failure_log.clear(("key", *key))
        return None

    def reconcile(self, key: tuple) -> None:
        """Dispatch `key` by its kind; raises what a retry may mend (and, for keys without an object, anything)."""
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
            self.gateways.reconcile()
        elif kind == "All":
            self.enqueue_all()
        else:
            raise ValueError(f"unknown key {key}")

    def _guarded(self, kind: str, ns: str, name: str) -> None:
        """Reconcile one ModelServer or InferencePool; a permanent failure becomes its ReconcileFailed condition
        (temporary ones propagate: the key is retried)."""
        reconciler = self.modelservers if kind == "ModelServer" else self.pools
        try:
            reconciler.reconcile(ns, name)
        except NotLeader:
            raise
        except Exception as exc:
            failure = classify(exc)
            if isinstance(failure, kopf.TemporaryError):
                raise failure from exc
            self.failure_log.log((kind, ns, name), failure)
            reconciler.report_failure(ns, name, failure)
        else:
            self.failure_log.clear((kind, ns, name))

    # --- one object, unguarded: its kind's reconciler, whose failures raise (for tests) ----------------------
    def reconcile_modelserver(self, ns: str, name: str) -> None:
        self.modelservers.reconcile(ns, name)

    def reconcile_pool(self, ns: str, name: str) -> None:
        self.pools.reconcile(ns, name)

    def reconcile_gateways(self) -> None:
        self.gateways.reconcile()
