"""Active-active EPP replicas deployed by the operator: a pool's annotations `kvgate.dev/epp-replicas: "N"` (N > 1,
with `--epp-high-availability enabled`) and `kvgate.dev/epp-mode: active-active`.

Every replica serves (no Lease, no leader: Envoy sends streams to each ready EPP), and they keep each other's
view of the pool's in-flight requests and prefix placements by peer sync (epp/peer_sync.py):

- peers: each EPP finds the others by watching its own pods (`kvgate epp --peer-sync-discover-pods`, the EPP's
  selector labels; its Role already reads the namespace's pods) and connects to each running one's pod IP at the
  sync port (EPP_PEER_SYNC_PORT), following scale-ups, rollouts and deaths;
- the key: a CURVE keypair the operator generates once per pool into the Secret `<epp>-peer-sync` (created only
  when absent, never read nor rewritten by the operator: its RBAC is `create` on Secrets; owned by the pool, so
  deleted with it), mounted into the EPP pods; only holders of it complete a handshake on the sync port, and
  every message is encrypted (epp/peer_sync_keys.py). Deleting the Secret and rolling the EPP rotates the key;
- the port: the pool's EPP NetworkPolicy (network_policy.py) admits the sync port only from the pool's own EPP
  pods.

`active-passive` (the default) keeps one leading replica elected over a Lease (epp/leader.py).
"""

from __future__ import annotations

import base64

from kvgate.operator import naming

MODE_ANNOTATION = "kvgate.dev/epp-mode"
ACTIVE_PASSIVE, ACTIVE_ACTIVE = "active-passive", "active-active"
EPP_PEER_SYNC_PORT = 9004
KEY_DIR = "/peer-sync"
SECRET_KEY = "pool.key"
KEY_FILE = f"{KEY_DIR}/{SECRET_KEY}"


def epp_mode(pool: dict) -> str:
    """The pool's EPP mode (annotation kvgate.dev/epp-mode; default active-passive); ValueError saying why a value
    is not one."""
    value = ((pool.get("metadata") or {}).get("annotations") or {}).get(MODE_ANNOTATION)
    if value is None:
        return ACTIVE_PASSIVE
    if value not in (ACTIVE_PASSIVE, ACTIVE_ACTIVE):
        raise ValueError(f"annotation {MODE_ANNOTATION}={str(value)[:40]!r}: expected {ACTIVE_PASSIVE} or "
                         f"{ACTIVE_ACTIVE}")
    return value


def secret_name(pool: dict) -> str:
    return naming._dns_label(f"{naming.epp_name(pool)}-peer-sync")


def peer_sync_secret(pool: dict, key_text: str) -> dict:
    """The pool's peer-sync key Secret (`key_text`: epp.peer_sync_keys.new_pool_key_text())."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": naming.object_meta(secret_name(pool), pool,
                                           naming.component_labels("epp", naming.name_of(pool))),
            "data": {SECRET_KEY: base64.b64encode(key_text.encode()).decode()}}


def pod_selector(pool: dict) -> str:
    """The EPP pods' selector labels as a label selector: the peers an EPP watches for."""
    return ",".join(f"{k}={v}" for k, v in sorted(naming.selector_labels("epp", naming.name_of(pool)).items()))


def peer_sync_args(pool: dict) -> list[str]:
    """The EPP's peer-sync flags: publish on the pod's own IP (no wider), the pool's key, peers by pod watch."""
    return ["--peer-sync-bind", f"tcp://$(POD_IP):{EPP_PEER_SYNC_PORT}", "--peer-sync-key-file", KEY_FILE,
            "--peer-sync-discover-pods", pod_selector(pool)]


def with_peer_sync(deployment: dict, pool: dict) -> dict:
    """The EPP Deployment (pool.py) with peer sync: the flags, POD_IP, the sync port and the key's volume."""
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    container["command"] = [*container["command"], *peer_sync_args(pool)]
    container["env"] = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                        *container["env"]]
    container["ports"] = [*container["ports"],
                          {"name": "peer-sync", "containerPort": EPP_PEER_SYNC_PORT, "protocol": "TCP"}]
    container["volumeMounts"] = [*container["volumeMounts"], {"name": "peer-sync", "mountPath": KEY_DIR,
                                                              "readOnly": True}]
    # owner-read and group-read for the pod's fsGroup: the EPP runs as a non-root user
    pod["volumes"] = [*pod["volumes"], {"name": "peer-sync", "secret": {"secretName": secret_name(pool),
                                                                         "defaultMode": 0o440}}]
    pod["securityContext"] = {**pod["securityContext"], "fsGroup": pod["securityContext"].get("runAsGroup", 65532)}
    return deployment


def peer_sync_policy_rule(pool: dict) -> list[dict]:
    """The EPP NetworkPolicy's ingress rule for the sync port: from the pool's own EPP pods only."""
    return [{"from": [{"podSelector": {"matchLabels": naming.selector_labels("epp", naming.name_of(pool))}}],
             "ports": [{"protocol": "TCP", "port": EPP_PEER_SYNC_PORT}]}]
