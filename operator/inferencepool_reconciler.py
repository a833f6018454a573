"""The InferencePool reconciler: a pool the operator manages gets its EPP's objects and its NetworkPolicies.

Which pools are the operator's, and the objects of their EPP, are pool.py's; the policies network_policy.py's.
Per reconcile the pool's EndpointPickerConfig is read from its ConfigMap (re-read each time: every resync at the
latest; a ConfigMap labelled kvgate.dev/epp-config also wakes its pools at once: watches.py) and parsed once.
The policies are applied before the EPP's pods, which never run unprotected. Whatever stops the EPP from being
rolled out, or from running all that was asked, is the pool's EPP entry in status.parents.
"""

from __future__ import annotations

import logging

import kopf

from kvgate.operator import naming
from kvgate.operator.apply import (CONFIGMAP, GATEWAY, GATEWAYCLASS, HTTPROUTE, MODELSERVER, NETWORKPOLICY, PDB,
                                   PDB_V1BETA1, POOL, REFERENCEGRANT, SERVICE, ApiError, Kube, NameConflict,
                                   describe)
from kvgate.operator.config import OperatorConfig
from kvgate.operator.epp_peer_sync import ACTIVE_ACTIVE, epp_mode, peer_sync_secret
from kvgate.epp.peer_sync_keys import new_pool_key_text
from kvgate.operator.failures import REASON as FAILED, failure_message
from kvgate.operator.gateway import is_our_class
from kvgate.operator.network_policy import (desired_engine_network_policy, desired_network_policy,
                                            engine_policy_enabled, engine_policy_name, gateways_routing_to,
                                            policy_enabled)
from kvgate.operator.pool import (choose_epp_config, epp_pool_status, epp_problems, epp_ref, epp_replicas,
                                  epp_tokenizer_for_config, manages_epp, pod_disruption_budget, referenced_config_name,
                                  render_epp_objects, running_note, without_epp_status)

log = logging.getLogger("kvgate.operator")


class InferencePoolReconciler:
    def __init__(self, kube: Kube, config: OperatorConfig) -> None:
        self.kube, self.config = kube, config

    def reconcile(self, ns: str, name: str) -> None:
        pool = self.kube.get(POOL, name, ns)
        if pool is None or naming.is_deleting(pool):
            return
        ref = epp_ref(pool)
        service = self.kube.get(SERVICE, ref["name"], ns) if isinstance(ref.get("name"), str) else None
        modelservers = self.kube.list(MODELSERVER, ns)
        if not manages_epp(pool, service, modelservers):
            if (status := without_epp_status(pool)) is not None:  # no longer ours: drop our status entry
                self.kube.patch_status(pool, status)
            return
        config_name = referenced_config_name(pool)
        choice = choose_epp_config(pool, self.kube.get(CONFIGMAP, config_name, ns) if config_name else None,
                                   self.kube.get(CONFIGMAP, naming.epp_name(pool), ns), modelservers)
        own_problems = epp_problems(pool, None)  # the pool's own: its spec, its endpointPickerRef
        problems = own_problems + ([choice.problem] if choice.problem else [])
        invalid_spec = bool(problems) and problems[0]["reason"] == "InvalidSpec"
        if invalid_spec:  # nothing can be rendered from it
            problems = problems[:1]
        replicas, replica_problem = self._replicas(pool)
        if replica_problem:  # one EPP runs meanwhile
            problems.append(replica_problem)
        active_active, mode_problem = self._active_active(pool, replicas)
        if mode_problem:  # active-passive meanwhile
            problems.append(mode_problem)
        if not invalid_spec and self.config.network_policy:  # before the EPP's pods: they never run unprotected
            problems += self._apply_epp_network_policy(pool, active_active) \
                + self._apply_engine_network_policy(pool, modelservers)
        tokenizer = epp_tokenizer_for_config(choice.parsed, pool, modelservers)
        if tokenizer.problem:  # the EPP still runs (it routes without the precise scorer's hits); the status says why
            problems.append(tokenizer.problem)
        # choice.config_yaml parses (choose_epp_config parsed it), so only the pool's own problems stop the EPP.
        objects = render_epp_objects(pool, self.config.epp_image, choice.config_yaml,
                                     behind_service=self.config.epp_address_mode == "service", tokenizer=tokenizer,
                                     replicas=replicas, tracing=self.config.tracing, active_active=active_active) \
            if choice.config_yaml is not None and not own_problems and not _conflicts(problems) else []
        if objects and active_active:  # the key before the pods that mount it
            self.kube.create(peer_sync_secret(pool, new_pool_key_text()))
        for obj in objects:  # in order; a name taken by someone else stops the rest (the EPP needs them all)
            try:
                self.kube.apply(obj)
            except NameConflict as exc:
                problems.append({"reason": exc.reason, "message": str(exc)})
                break
        if objects and self.config.epp_high_availability:
            problems += self._apply_disruption_budget(pool, replicas)
        status = epp_pool_status(pool, problems, running_note(choice, bool(objects)))
        if problems and status["parents"] != (pool.get("status") or {}).get("parents"):  # once, not every resync
            log.warning("%s: %s", describe(pool), "; ".join(p["message"] for p in problems))
        self.kube.patch_status(pool, status)

    def report_failure(self, ns: str, name: str, failure: kopf.PermanentError) -> None:
        """A permanent failure as the pool's EPP entry (Accepted=False, reason ReconcileFailed)."""
        pool = self.kube.get(POOL, name, ns)
        if pool is None:
            return
        message = failure_message(failure)
        self.kube.patch_status(pool, epp_pool_status(pool, [{"reason": FAILED, "message": message}],
                                                     "The EPP keeps running what it ran."))

    def _replicas(self, pool: dict) -> tuple[int, dict | None]:
        """The EPP replicas to run, and the problem with what the pool asked, if any."""
        try:
            asked = epp_replicas(pool)
        except ValueError as exc:
            return 1, {"reason": "InvalidReplicas", "message": str(exc)}
        if asked > 1 and not self.config.epp_high_availability:
            return 1, {"reason": "HighAvailabilityDisabled",
                       "message": f"{asked} EPP replicas asked, but this operator runs one per pool: start it with "
                                  "--epp-high-availability enabled (the chart's eppHighAvailability.enabled)"}
        return asked, None

    def _active_active(self, pool: dict, replicas: int) -> tuple[bool, dict | None]:
        """Whether the pool's replicas all serve, synced (epp_peer_sync.py), and the problem with its mode."""
        try:
            return epp_mode(pool) == ACTIVE_ACTIVE and replicas > 1, None
        except ValueError as exc:
            return False, {"reason": "InvalidEppMode", "message": str(exc)}

    def _apply_disruption_budget(self, pool: dict, replicas: int) -> list[dict]:
        """With several replicas the EPP's PodDisruptionBudget (policy/v1, else v1beta1 on Kubernetes < 1.21);
        with one, none (a budget of one pod would block node drains)."""
        ns, name = naming.namespace_of(pool), naming.epp_name(pool)
        if replicas == 1:
            for kind in (PDB, PDB_V1BETA1):  # None also where that API version is not served
                existing = self.kube.get(kind, name, ns)
                if naming.is_managed(existing) and naming.is_owned_by(existing, pool):
                    self.kube.delete(existing)
            return []
        for version in ("policy/v1", "policy/v1beta1"):
            try:
                self.kube.apply(pod_disruption_budget(pool, version))
                return []
            except NameConflict as exc:
                return [{"reason": exc.reason, "message": str(exc)}]
            except ApiError as exc:
                if exc.status != 404 or version == "policy/v1beta1":
                    raise
        return []

    def _apply_epp_network_policy(self, pool: dict, peer_sync: bool = False) -> list[dict]:
        """Apply (or, for an opted-out pool, delete) the EPP's NetworkPolicy; its problems."""
        ns = naming.namespace_of(pool)
        if not policy_enabled(pool):
            existing = self.kube.get(NETWORKPOLICY, naming.epp_name(pool), ns)
            if naming.is_managed(existing) and naming.is_owned_by(existing, pool):
                self.kube.delete(existing)
            return []
        using = self._gateways_using(pool)
        policy, problems = desired_network_policy(pool, using, self.config.epp_metrics_from, peer_sync=peer_sync)
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
                                                   trust_annotations=False, peer_sync=peer_sync)[0])
            problems.append({"reason": "NetworkPolicyRejected",
                             "message": f"the NetworkPolicy with the pool's peer annotations was refused: {exc}"})
        return problems

    def _apply_engine_network_policy(self, pool: dict, modelservers: list[dict]) -> list[dict]:
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
            problems.append({"reason": "NetworkPolicyRejected", "message": (
                f"the engines' NetworkPolicy with the pool's peer annotations was refused: {exc}")})
        return problems

    def _gateways_using(self, pool: dict) -> list[dict]:
        """The operator's Gateways whose HTTPRoutes send traffic to `pool` (network_policy.gateways_routing_to)."""
        ns, scope = naming.namespace_of(pool), self.config.namespace
        classes = {naming.name_of(gc) for gc in self.kube.list(GATEWAYCLASS) if is_our_class(gc)}
        gateways = [g for g in self.kube.list(GATEWAY, scope)
                    if (g.get("spec") or {}).get("gatewayClassName") in classes and not naming.is_deleting(g)]
        routes = self.kube.list(HTTPROUTE, scope)
        grants = self.kube.list(REFERENCEGRANT, ns) if any(
            naming.namespace_of(r) != ns for r in routes) else []
        return gateways_routing_to(pool, routes, gateways, grants)


def _conflicts(problems: list[dict]) -> bool:
    return any(p["reason"] == NameConflict.reason for p in problems)
