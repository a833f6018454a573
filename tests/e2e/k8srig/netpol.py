"""NetworkPolicy for the rig's pods, pure: which pods may open which ports of which pods, as an nftables ruleset.

What a CNI's policy agent computes (Calico's Felix, Cilium's agent), for ingress, following the
networking.k8s.io/v1 rules:

- a pod is isolated for ingress once any policy of its namespace selects it (`spec.podSelector`, empty =
  every pod) with `Ingress` in its policy types (absent types: `Ingress`, plus `Egress` when the policy has
  egress rules); an isolated pod admits only what the union of those policies' ingress rules admits;
- a rule admits its peers (absent or empty `from`: every source) on its ports (absent or empty `ports`:
  every port); a peer is a podSelector (pods of the policy's namespace), a namespaceSelector (every pod of
  those namespaces), both (those pods of those namespaces), or an ipBlock (pods whose IP it holds, less its
  `except`); a port is a number or a name looked up in the destination pod's container ports, with a
  protocol (TCP by default) and optionally an `endPort`;
- a pod can always reach itself, and traffic from the node (the pod runner, its probes and service proxy,
  the control plane, the tests themselves) is always admitted, as on the common CNIs.

Egress isolation is not enforced here (nothing kvgate makes asks for it); `egress_ignored` names the
policies that ask, so the rig can say so instead of pretending.

The rig's pods all share the loopback interface, so a packet's source address does not say which pod sent
it. The sending socket does: every pod runs in a cgroup of its own, and the ruleset matches the socket's
cgroup (nftables `socket cgroupv2`) on the output hook, judging the first packet of each connection (a TCP
SYN, any UDP/SCTP packet) sent to an isolated pod's IP. A refused TCP connection gets a reset (the client
sees "connection refused" at once, as with Calico's default REJECT), anything else an ICMP reject.
"""
from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

PROTOCOLS = ("TCP", "UDP", "SCTP")


@dataclass(frozen=True)
class PodInfo:
    """A pod as the policy agent sees it."""
    namespace: str
    name: str
    ip: str
    cgroup: str                                        # its cgroup, as nftables names it (relative path)
    labels: Mapping[str, str] = field(default_factory=dict)
    named_ports: Mapping[str, tuple[str, int]] = field(default_factory=dict)   # name -> (protocol, port)

    @property
    def key(self) -> tuple[str, str]:
        return self.namespace, self.name


@dataclass(frozen=True)
class PortRange:
    protocol: str          # TCP, UDP or SCTP
    first: int | None      # None: every port of the protocol
    last: int | None = None


@dataclass(frozen=True)
class Allowance:
    """Sources (pod keys, or None for everyone) that may reach the pod on ports (None: every port)."""
    sources: frozenset[tuple[str, str]] | None
    ports: tuple[PortRange, ...] | None


@dataclass(frozen=True)
class Isolation:
    """An ingress-isolated pod and what its policies admit (nothing, when `allowances` is empty)."""
    pod: PodInfo
    allowances: tuple[Allowance, ...]


# --- label selectors ---------------------------------------------------------------------------------------------

def selector_matches(selector: Mapping | None, labels: Mapping[str, str]) -> bool:
    """metav1.LabelSelector semantics: an empty selector matches everything; a null one is handled by callers."""
    selector = selector or {}
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr.get("key"), expr.get("operator"), expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
        if op not in ("In", "NotIn", "Exists", "DoesNotExist"):
            return False                  # the API server refuses these; never match what cannot be read
    return True


# --- policy evaluation -------------------------------------------------------------------------------------------

def policy_types(policy: Mapping) -> list[str]:
    spec = policy.get("spec") or {}
    if spec.get("policyTypes"):
        return list(spec["policyTypes"])
    return ["Ingress"] + (["Egress"] if spec.get("egress") else [])


def egress_ignored(policies: Iterable[Mapping]) -> list[str]:
    """namespace/name of the policies that ask for egress isolation (not enforced by the rig)."""
    return sorted(f"{(p.get('metadata') or {}).get('namespace')}/{(p.get('metadata') or {}).get('name')}"
                  for p in policies if "Egress" in policy_types(p))


def _peer_pods(peer: Mapping, policy_ns: str, pods: Iterable[PodInfo],
               namespaces: Mapping[str, Mapping[str, str]]) -> set[tuple[str, str]]:
    if "ipBlock" in peer:
        block = peer["ipBlock"] or {}
        try:
            cidr = ipaddress.ip_network(block.get("cidr", ""), strict=False)
            excepts = [ipaddress.ip_network(e, strict=False) for e in block.get("except") or []]
        except ValueError:
            return set()
        out = set()
        for pod in pods:
            ip = ipaddress.ip_address(pod.ip)
            if ip in cidr and not any(ip in e for e in excepts):
                out.add(pod.key)
        return out
    pod_sel, ns_sel = peer.get("podSelector"), peer.get("namespaceSelector")
    if pod_sel is None and ns_sel is None:
        return set()                       # an empty peer: the API server refuses it
    out = set()
    for pod in pods:
        if ns_sel is None:
            if pod.namespace != policy_ns:
                continue
        elif not selector_matches(ns_sel, namespaces.get(pod.namespace, {})):
            continue
        if pod_sel is not None and not selector_matches(pod_sel, pod.labels):
            continue
        out.add(pod.key)
    return out


def _port_ranges(ports: list[Mapping] | None, dest: PodInfo) -> tuple[PortRange, ...] | None:
    if not ports:
        return None
    out = []
    for p in ports:
        protocol = (p.get("protocol") or "TCP").upper()
        port = p.get("port")
        if port is None:
            out.append(PortRange(protocol, None))
        elif isinstance(port, str) and not port.isdigit():
            named = dest.named_ports.get(port)
            if named and named[0] == protocol:
                out.append(PortRange(protocol, named[1], named[1]))
            # a name the pod does not have admits nothing on it
        else:
            first = int(port)
            last = int(p.get("endPort") or first)
            out.append(PortRange(protocol, first, max(first, last)))
    return tuple(out)


def ingress_isolations(policies: Iterable[Mapping], pods: Iterable[PodInfo],
                       namespaces: Mapping[str, Mapping[str, str]]) -> list[Isolation]:
    """Every ingress-isolated pod with what its policies admit, in pod order."""
    pods = list(pods)
    policies = [p for p in policies if "Ingress" in policy_types(p)]
    out = []
    for dest in pods:
        selecting = [p for p in policies if (p.get("metadata") or {}).get("namespace") == dest.namespace
                     and selector_matches((p.get("spec") or {}).get("podSelector"), dest.labels)]
        if not selecting:
            continue
        allowances = []
        for policy in selecting:
            ns = policy["metadata"]["namespace"]
            for rule in (policy.get("spec") or {}).get("ingress") or []:
                ports = _port_ranges(rule.get("ports"), dest)
                if ports == ():
                    continue                 # only named ports this pod lacks: admits nothing here
                peers = rule.get("from")
                sources = None if not peers else frozenset().union(
                    *(_peer_pods(peer, ns, pods, namespaces) for peer in peers))
                if sources is not None and not sources:
                    continue
                allowances.append(Allowance(sources, ports))
        out.append(Isolation(dest, tuple(allowances)))
    return out


# --- nftables ------------------------------------------------------------------------------------------------

def _quote(path: str) -> str:
    if '"' in path or "\n" in path:
        raise ValueError(f"cgroup path {path!r} cannot be quoted for nft")
    return f'"{path}"'


def _port_match(port: PortRange) -> str:
    proto = port.protocol.lower()
    if port.first is None:
        return f"meta l4proto {proto}"
    span = str(port.first) if port.last in (None, port.first) else f"{port.first}-{port.last}"
    return f"meta l4proto {proto} th dport {span}"


def render_ruleset(table: str, isolations: Iterable[Isolation], pods_by_key: Mapping[tuple[str, str], PodInfo],
                   *, pod_level: int, rig_cgroup: str) -> str:
    """An `nft -f` script that replaces table `inet TABLE` with the rules for these isolations, atomically.

    pod_level: the depth of the pods' cgroups in the cgroup2 hierarchy; their parent, `rig_cgroup` (at
    pod_level - 1), holds every pod of the rig and no other process, so a socket outside it is the node's."""
    lines = [f"table inet {table} {{}}", f"delete table inet {table}", f"table inet {table} {{",
             "  chain output {",
             "    type filter hook output priority filter; policy accept;",
             '    oifname != "lo" accept',
             # Only a connection's first packet is judged: replies and established flows pass.
             "    meta l4proto tcp tcp flags & (syn | ack) != syn accept"]
    chains = []
    for i, iso in enumerate(isolations):
        chain = f"to_{i}"
        lines.append(f"    ip daddr {iso.pod.ip} jump {chain}")
        body = [f"  chain {chain} {{",
                f"    # {iso.pod.namespace}/{iso.pod.name}",
                f"    socket cgroupv2 level {pod_level} {_quote(iso.pod.cgroup)} accept"]
        for allowance in iso.allowances:
            if allowance.sources is None:
                who = ""
            else:
                paths = sorted(pods_by_key[k].cgroup for k in allowance.sources if k in pods_by_key)
                if not paths:
                    continue
                who = f"socket cgroupv2 level {pod_level} {{ {', '.join(_quote(p) for p in paths)} }} "
            for port in allowance.ports or (None,):
                what = "" if port is None else _port_match(port) + " "
                body.append(f"    {what}{who}accept")
        body += [f"    meta l4proto tcp socket cgroupv2 level {pod_level - 1} {_quote(rig_cgroup)} "
                 "reject with tcp reset",
                 f"    socket cgroupv2 level {pod_level - 1} {_quote(rig_cgroup)} reject",
                 "  }"]
        chains += body
    lines.append("  }")
    lines += chains
    lines.append("}")
    return "\n".join(lines) + "\n"
