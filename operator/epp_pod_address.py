"""`--epp-address-mode pod-ip`: the Gateways reach each pool's EPP by its ready pods' IPs, not its Service's name.

For clusters without Service routing (the e2e rig has no kube-proxy). Pure functions over the objects the
Gateway reconciler listed: a rendered routing's pool backends get the EPP pods behind their EPP Service.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from kvgate.common.envoy_config import PoolBackend
from kvgate.operator import naming
from kvgate.common.gateway_routes import WeightedBackend
from kvgate.operator.gateway import GatewayRouting


def _ready_pods(pods: list[dict], selector: dict[str, str]) -> list[dict]:
    def ready(p):
        return any(c.get("type") == "Ready" and c.get("status") == "True"
                   for c in (p.get("status") or {}).get("conditions") or [])
    return sorted((p for p in pods if selector and not naming.is_deleting(p) and (p.get("status") or {}).get("podIP")
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


def routing_via_epp_pods(routing: GatewayRouting, services: list[dict],
                         pods_of: Callable[[str], list[dict]]) -> GatewayRouting:
    """`routing` with each pool backend reaching its EPP by pod IP (epp_backend_via_pod); `pods_of(namespace)`:
    the pods of a namespace, asked only for the namespaces of the EPP Services the routing uses."""
    svc_by_key = {naming.key_of(s): s for s in services}
    swapped: dict[str, PoolBackend] = {}

    def swap(backend):
        if not isinstance(backend, PoolBackend):
            return backend
        if backend.name not in swapped:
            # PoolBackend.name is "<namespace>-<pool>" and epp_host "<service>.<namespace>.svc..."
            svc_name, _, rest = backend.epp_host.partition(".")
            svc_ns = rest.split(".", 1)[0]
            swapped[backend.name] = epp_backend_via_pod(backend, svc_by_key.get((svc_ns, svc_name)), pods_of(svc_ns))
        return swapped[backend.name]

    rules = [dataclasses.replace(r, backends=[WeightedBackend(swap(w.backend), w.weight) for w in r.backends])
             for r in routing.rules]
    return routing._replace(rules=rules)
