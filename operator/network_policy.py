"""The NetworkPolicy in front of each operator-made EPP: who may reach its ext-proc, health and metrics ports.

On by default (`kvgate operator --epp-network-policy enabled`). One policy per managed pool, named like the
EPP's other objects and owned by the pool (garbage-collected with it); it selects the EPP's pods and allows
ingress only:

- to ext-proc (9002) and gRPC health (9003), from the Envoy pods of the operator's Gateways whose HTTPRoutes
  reference the pool (a reference from another namespace counts only with a ReferenceGrant allowing it, as
  for routing), and from the peers of the pool's annotation `kvgate.dev/epp-ingress-from` (the proxies of
  another gateway implementation — Istio, Envoy Gateway, ... — whose pods the operator does not know);
- to metrics (9090), from the peers of `--epp-metrics-from` (the operator's, for every pool: a Prometheus; the
  chart adds the operator's own pods, whose autoscaler reads every EPP's load: autoscaler.py) and of the pool's
  annotation `kvgate.dev/epp-metrics-from`;
- to peer sync (9004; active-active replicas only, epp_peer_sync.py), from the pool's own EPP pods.

No peer for a port means no ingress to it at all: a rule with an empty `from` would admit everyone, so none
is ever written. Peers are NetworkPolicyPeer lists in YAML or JSON, e.g.
`[{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: monitoring}}}]`. A Gateway in another
namespace than the pool is matched by the namespace label `kubernetes.io/metadata.name` (set by Kubernetes
1.21 and later; label the namespace by hand on older clusters). `kvgate.dev/epp-network-policy: disabled` on
a pool opts it out: the operator then deletes the policy it wrote. The kubelet's probes are not affected on
the common CNIs: traffic from the node to its own pods is always allowed.

A second policy per managed pool, `<pool>-engines`, selects the pool's operator-made engine pods (the pool's
selector labels and `app.kubernetes.io/name: kvgate-engine`) and allows ingress only:

- to the engine's HTTP port (the pool's first target port: completions, /metrics), from the same Envoy pods,
  from the pool's EPP pods (it scrapes /metrics), from the peers of `kvgate.dev/epp-ingress-from` (another
  gateway implementation's proxies send requests to the engines too) and from those of the pool's annotation
  `kvgate.dev/engine-ingress-from` (e.g. a Prometheus, or in-cluster clients that bypass the gateway);
- to the KV-event PUB and replay ports of the pool's ModelServers (`spec.engine.kvEvents`), from the pool's EPP
  pods only: the events carry every prompt's token ids and the tenants' cache salts (README, Security).

`kvgate.dev/engine-network-policy: disabled` opts a pool's engines out. Engines the operator did not make (a
pool whose members are someone else's pods) are not selected: their owner writes their policy.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import yaml

from kvgate.common import bounded_yaml
from kvgate.operator import naming
from kvgate.operator.epp_peer_sync import peer_sync_policy_rule
from kvgate.operator.gateway import _grant_allows
from kvgate.operator.modelserver import kv_events_ports, pool_labels, pool_port
from kvgate.operator.spec_shape import pool_problems, pool_ref_name

POLICY_ANNOTATION = "kvgate.dev/epp-network-policy"  # "disabled": no policy for this pool's EPP
INGRESS_FROM_ANNOTATION = "kvgate.dev/epp-ingress-from"  # more peers for ext-proc and health
METRICS_FROM_ANNOTATION = "kvgate.dev/epp-metrics-from"  # more peers for metrics
ENGINE_POLICY_ANNOTATION = "kvgate.dev/engine-network-policy"  # "disabled": no policy for the pool's engines
ENGINE_INGRESS_FROM_ANNOTATION = "kvgate.dev/engine-ingress-from"  # more peers for the engines' HTTP port
ENGINE_POD_NAME = naming.component_labels("engine", "")["app.kubernetes.io/name"]  # kvgate-engine
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
EXT_PROC_PORTS = (naming.EPP_GRPC_PORT, naming.EPP_HEALTH_PORT)

_PEER_FIELDS = {"podSelector", "namespaceSelector", "ipBlock"}
_SELECTOR_OPERATORS = {"In", "NotIn", "Exists", "DoesNotExist"}


# --- peers from the user ------------------------------------------------------------------------------------

def _check_selector(selector, where: str) -> None:
    if not isinstance(selector, Mapping) or set(selector) - {"matchLabels", "matchExpressions"}:
        raise ValueError(f"{where}: a label selector has only matchLabels and matchExpressions")
    labels = selector.get("matchLabels") or {}
    if not isinstance(labels, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        raise ValueError(f"{where}.matchLabels: expected a mapping of strings to strings")
    for i, expr in enumerate(selector.get("matchExpressions") or []):
        if not isinstance(expr, Mapping) or not isinstance(expr.get("key"), str) \
                or not isinstance(expr.get("operator"), str) or expr["operator"] not in _SELECTOR_OPERATORS \
                or not isinstance(expr.get("values", []), list):
            raise ValueError(f"{where}.matchExpressions[{i}]: expected key, operator "
                             f"({', '.join(sorted(_SELECTOR_OPERATORS))}) and a list of values")


def parse_peers(text: str | None, source: str) -> list[dict]:
    """A NetworkPolicyPeer list from YAML or JSON text ([] for empty text); ValueError naming the problem."""
    if text is None or not text.strip():
        return []
    try:
        doc = bounded_yaml.load(text)  # a tenant's annotation: bounded nesting, aliases and size
    except yaml.YAMLError as exc:
        raise ValueError(f"{source}: not valid YAML: {' '.join(str(exc).split())[:500]}") from None
    if isinstance(doc, Mapping):
        doc = [doc]
    if not isinstance(doc, list):
        raise ValueError(f"{source}: expected a list of NetworkPolicy peers")
    for i, peer in enumerate(doc):
        where = f"{source}[{i}]"
        if not isinstance(peer, Mapping) or not peer or set(peer) - _PEER_FIELDS:
            raise ValueError(f"{where}: a peer has podSelector and/or namespaceSelector, or ipBlock")
        if "ipBlock" in peer:
            block = peer["ipBlock"]
            if len(peer) > 1 or not isinstance(block, Mapping) or not isinstance(block.get("cidr"), str) \
                    or not isinstance(block.get("except", []), list):
                raise ValueError(f"{where}: ipBlock stands alone and has a cidr (and an except list)")
        for field in ("podSelector", "namespaceSelector"):
            if field in peer:
                _check_selector(peer[field], f"{where}.{field}")
    return [dict(peer) for peer in doc]


def _annotation(pool: dict, key: str) -> str | None:
    return ((pool.get("metadata") or {}).get("annotations") or {}).get(key)


def policy_enabled(pool: dict) -> bool:
    return (_annotation(pool, POLICY_ANNOTATION) or "").strip().lower() != "disabled"


def engine_policy_enabled(pool: dict) -> bool:
    return (_annotation(pool, ENGINE_POLICY_ANNOTATION) or "").strip().lower() != "disabled"


# --- the pool's gateways ------------------------------------------------------------------------------------

def route_refs(route: dict) -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    """((ns, pool) of the route's InferencePool backendRefs, (ns, name) of its Gateway parentRefs)."""
    ns = naming.namespace_of(route)
    spec = route.get("spec") or {}
    pools = {(ref.get("namespace", ns), ref.get("name", ""))
             for rule in spec.get("rules") or [] for ref in rule.get("backendRefs") or []
             if ref.get("group") == naming.INFERENCE_GROUP and ref.get("kind") == "InferencePool"}
    gateways = {(ref.get("namespace", ns), ref.get("name", "")) for ref in spec.get("parentRefs") or []
                if ref.get("group", naming.GATEWAY_GROUP) == naming.GATEWAY_GROUP
                and ref.get("kind", "Gateway") == "Gateway"}
    return pools, gateways


def gateways_routing_to(pool: dict, httproutes: Iterable[dict], our_gateways: Iterable[dict],
                        referencegrants: Iterable[dict]) -> list[dict]:
    """The Gateways (of `our_gateways`) that an HTTPRoute referencing `pool` is attached to, sorted."""
    by_key = {naming.key_of(g): g for g in our_gateways}
    pool_ns, pool_name = naming.key_of(pool)
    grants = list(referencegrants)
    out = {}
    for route in httproutes:
        pools, parents = route_refs(route)
        if (pool_ns, pool_name) not in pools:
            continue
        if pool_ns != naming.namespace_of(route) and not _grant_allows(
                grants, route, pool_ns, naming.INFERENCE_GROUP, "InferencePool", pool_name):
            continue
        for key in parents:
            if key in by_key:
                out[key] = by_key[key]
    return [out[k] for k in sorted(out)]


def gateway_peer(gateway: dict, pool_namespace: str) -> dict:
    """The Gateway's Envoy pods (their selector labels in gateway.py), seen from a policy in `pool_namespace`."""
    peer = {"podSelector": {"matchLabels": naming.selector_labels("gateway", naming.name_of(gateway))}}
    if naming.namespace_of(gateway) != pool_namespace:
        peer["namespaceSelector"] = {"matchLabels": {NAMESPACE_NAME_LABEL: naming.namespace_of(gateway)}}
    return peer


# --- the policy ---------------------------------------------------------------------------------------------

def _rule(peers: list[dict], ports: Iterable[int]) -> list[dict]:
    ports = list(ports)
    if not peers or not ports:  # a rule without `from` (or `ports`) admits every source (port): write none instead
        return []
    return [{"from": peers, "ports": [{"protocol": "TCP", "port": p} for p in ports]}]


def desired_network_policy(pool: dict, gateways: list[dict], metrics_from: Iterable[dict] = (),
                           trust_annotations: bool = True, peer_sync: bool = False) -> tuple[dict, list[dict]]:
    """(the EPP's NetworkPolicy, problems) for `pool` whose traffic comes from `gateways` (see
    gateways_routing_to). An unreadable peer annotation is a problem ({reason, message}) and adds no peer;
    `trust_annotations` False leaves the annotations' peers out (when the API server refused them). `peer_sync`:
    active-active replicas, whose sync port admits the pool's own EPP pods only (epp_peer_sync.py)."""
    problems, extra = [], {}
    for key in (INGRESS_FROM_ANNOTATION, METRICS_FROM_ANNOTATION):
        try:
            extra[key] = parse_peers(_annotation(pool, key), f"annotation {key}") if trust_annotations else []
        except ValueError as exc:
            problems.append({"reason": "InvalidNetworkPolicyPeers", "message": str(exc)})
            extra[key] = []
    ns = naming.namespace_of(pool)
    ext_proc_from = [gateway_peer(g, ns) for g in gateways] + extra[INGRESS_FROM_ANNOTATION]
    policy = {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": naming.object_meta(naming.epp_name(pool), pool,
                                       naming.component_labels("epp", naming.name_of(pool))),
        "spec": {
            "podSelector": {"matchLabels": naming.selector_labels("epp", naming.name_of(pool))},
            "policyTypes": ["Ingress"],
            "ingress": _rule(ext_proc_from, EXT_PROC_PORTS)
                       + _rule(list(metrics_from) + extra[METRICS_FROM_ANNOTATION], [naming.EPP_METRICS_PORT])
                       + (peer_sync_policy_rule(pool) if peer_sync else []),
        },
    }
    return policy, problems


def engine_policy_name(pool: dict) -> str:
    return naming._dns_label(f"{naming.name_of(pool)}-engines")


def epp_peer(pool: dict) -> dict:
    """The pool's EPP pods (their selector labels in pool.py), from a policy in the pool's namespace."""
    return {"podSelector": {"matchLabels": naming.selector_labels("epp", naming.name_of(pool))}}


def desired_engine_network_policy(pool: dict, gateways: list[dict], modelservers: Iterable[dict],
                                  trust_annotations: bool = True) -> tuple[dict | None, list[dict]]:
    """(the NetworkPolicy of `pool`'s engine pods, problems); None when the pool selects no pods by labels (a
    policy would then select every engine of the namespace). `gateways`: see gateways_routing_to;
    `modelservers`: the namespace's, the pool's members among them give the KV-event ports."""
    labels = pool_labels(pool) if not pool_problems(pool) else {}
    if not labels or not (pool.get("spec") or {}).get("targetPorts"):
        return None, []
    problems, extra = [], []
    for key in (INGRESS_FROM_ANNOTATION, ENGINE_INGRESS_FROM_ANNOTATION):
        try:
            extra += parse_peers(_annotation(pool, key), f"annotation {key}") if trust_annotations else []
        except ValueError as exc:
            problems.append({"reason": "InvalidNetworkPolicyPeers", "message": str(exc)})
    ns, name = naming.key_of(pool)
    kv_ports = sorted({port for ms in modelservers
                       if naming.namespace_of(ms) == ns and pool_ref_name(ms) == name
                       for _, port, _ in kv_events_ports(ms.get("spec") or {})})
    http_from = [gateway_peer(g, ns) for g in gateways] + [epp_peer(pool)] + extra
    policy = {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": naming.object_meta(engine_policy_name(pool), pool, naming.component_labels("engine", name)),
        "spec": {
            # as on the pods (modelserver._operator_pod_labels): the pool's labels win over the operator's
            "podSelector": {"matchLabels": dict(sorted({"app.kubernetes.io/name": ENGINE_POD_NAME, **labels}.items()))},
            "policyTypes": ["Ingress"],
            "ingress": _rule(http_from, [pool_port(pool)]) + _rule([epp_peer(pool)], kv_ports),
        },
    }
    return policy, problems
