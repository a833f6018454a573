"""What the operator failover e2e tests share: leader election with short lease timings, which replica leads,
and the check that every object the operator made has exactly one live owner."""

from __future__ import annotations

import re

import httpx
from k8srig.kube import CORE, DEPLOYMENT, LEASE

LEASE_S, RENEW_S, RETRY_S = 4, 3, 0.5
MANAGED = "app.kubernetes.io/managed-by=kvgate-operator"
OWNER_KINDS = ("InferencePool", "ModelServer", "Gateway")
MADE_KINDS = {"Deployment": None, "Service": None, "ConfigMap": None, "ServiceAccount": None,
              "Role": "rbac.authorization.k8s.io/v1", "RoleBinding": "rbac.authorization.k8s.io/v1",
              "NetworkPolicy": "networking.k8s.io/v1"}


def leader_election_flags(namespace: str) -> list[str]:
    return ["--leader-election", "enabled", "--leader-election-namespace", namespace,
            "--leader-election-lease-duration", str(LEASE_S), "--leader-election-renew-deadline", str(RENEW_S),
            "--leader-election-retry-period", str(RETRY_S), "--liveness-host", "127.0.0.1"]


def leader_gauge(port: int) -> float | None:
    """An operator replica's kvgate_operator_leader gauge (1 leading, 0 standing by); None if it does not answer."""
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=3).text
    except httpx.HTTPError:
        return None
    found = re.search(r"^kvgate_operator_leader (\S+)$", text, re.M)
    return float(found.group(1)) if found else None


def lease_holder(client, namespace: str, name: str = "kvgate-operator") -> str | None:
    lease = client.get_or_none(LEASE, name, namespace)
    return ((lease or {}).get("spec") or {}).get("holderIdentity")


def made_objects(client, docs: dict[str, dict], namespace: str) -> dict[str, list[str]]:
    """{kind: names} of the operator's objects in `namespace`, asserting each has exactly one owner reference and
    that it names a live InferencePool, ModelServer or Gateway: nothing made twice, nothing orphaned."""
    owners = {o["metadata"]["uid"] for kind in OWNER_KINDS
              for o in client.list(client.resource_for(docs[kind]["apiVersion"], kind), namespace)["items"]}
    made: dict[str, list[str]] = {}
    for kind, version in MADE_KINDS.items():
        res = DEPLOYMENT if kind == "Deployment" else CORE.get(kind) or client.resource_for(version, kind)
        for o in client.list(res, namespace, labelSelector=MANAGED)["items"]:
            refs = o["metadata"].get("ownerReferences") or []
            assert len(refs) == 1 and refs[0]["uid"] in owners, (kind, o["metadata"]["name"], refs)
            made.setdefault(kind, []).append(o["metadata"]["name"])
    return {kind: sorted(names) for kind, names in made.items()}
