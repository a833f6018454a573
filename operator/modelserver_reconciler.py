"""The ModelServer reconciler: a ModelServer becomes its engine Deployment, and its status says how that went.

It reads the ModelServer and its namespace's pools (its own pool, and the others' selectors its pods must not
match: tenancy.py), builds the Deployment with the pure functions of modelserver.py and applies it. What cannot
be applied — a spec the validators refuse, a name taken by someone else's object, a Deployment the API server
rejects — is the ModelServer's Ready=False condition, and the Deployment it had keeps running.
"""

from __future__ import annotations

import logging

import kopf

from kvgate.operator import naming
from kvgate.operator.apply import DEPLOYMENT, MODELSERVER, POOL, ApiError, Kube, NameConflict, describe
from kvgate.operator.conditions import condition, stamp
from kvgate.operator.config import OperatorConfig
from kvgate.operator.engine_commands import engine_type
from kvgate.operator.failures import REASON as FAILED, failure_message
from kvgate.operator.modelserver import (desired_engine_deployment, modelserver_status, needs_recreate,
                                         validate_modelserver)
from kvgate.operator.spec_shape import pool_ref_name
from kvgate.operator.tenancy import privileged_uses

log = logging.getLogger("kvgate.operator")


class ModelServerReconciler:
    def __init__(self, kube: Kube, config: OperatorConfig) -> None:
        self.kube, self.config = kube, config
        self._uses_logged: dict[tuple[str, str], tuple] = {}  # ModelServer -> (generation, uses) last logged

    def reconcile(self, ns: str, name: str) -> None:
        ms = self.kube.get(MODELSERVER, name, ns)
        if ms is None or naming.is_deleting(ms):
            return
        pool_name = pool_ref_name(ms)
        pools = [p for p in self.kube.list(POOL, ns) if not naming.is_deleting(p)]  # its pool, the others' selectors
        pool = next((p for p in pools if naming.name_of(p) == pool_name), None)
        policy, image = self.config.tenant_policy, self.config.engine_images()
        problems = validate_modelserver(ms, pool, policy, pools, image)
        desired = None if problems else desired_engine_deployment(ms, pool, image, policy, pools,
                                                                  self.config.tracing)
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

    def report_failure(self, ns: str, name: str, failure: kopf.PermanentError) -> None:
        """A permanent failure as the ModelServer's Ready=False condition (reason ReconcileFailed)."""
        ms = self.kube.get(MODELSERVER, name, ns)
        if ms is None:
            return
        message = failure_message(failure)
        previous = (ms.get("status") or {}).get("conditions") or []
        failed = condition("Ready", False, FAILED, message, (ms.get("metadata") or {}).get("generation"))
        status = {"conditions": stamp([failed], previous) + [c for c in previous if c.get("type") != "Ready"]}
        self.kube.patch_status(ms, status)

    def _log_privileged_uses(self, ms: dict) -> None:
        """Log what an allowed ModelServer uses beyond the default (hostPath, another image): once per
        generation, so that each use is on record without a line every resync."""
        uses = privileged_uses(ms, self.config.engine_images().get(engine_type(ms.get("spec") or {})))
        key = naming.key_of(ms)
        seen = ((ms.get("metadata") or {}).get("generation"), tuple(uses))
        if uses and self._uses_logged.get(key) != seen:
            log.warning("%s uses %s (allowed by the operator's flags)", describe(ms), ", ".join(uses))
        self._uses_logged[key] = seen


def _deployment_of(ms: dict) -> dict:
    """The identity (kind, name, owner) of a ModelServer's engine Deployment, for ownership checks."""
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": naming.object_meta(naming.engine_deployment_name(ms), ms, {})}
