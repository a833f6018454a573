"""The rig's NetworkPolicy enforcement: the policy semantics (netpol.py, pure) and the kernel doing what the
rendered ruleset says (podnet.py: processes in per-pod cgroups, nftables), without the control plane."""
from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading

import pytest
from k8srig import netpol, podnet

A, B = "team-a", "team-b"
NAMESPACES = {A: {"kubernetes.io/metadata.name": A, "tier": "prod"}, B: {"kubernetes.io/metadata.name": B}}


def pod(ns, name, ip, labels=None, named_ports=None):
    return netpol.PodInfo(ns, name, ip, f"rig/pod-{name}", labels or {}, named_ports or {})


ENGINE = pod(A, "engine", "127.9.0.1", {"app": "engine"}, {"kv": ("TCP", 5557)})
EPP = pod(A, "epp", "127.9.0.2", {"app": "epp"})
OTHER = pod(A, "other", "127.9.0.3", {"app": "other"})
STRANGER = pod(B, "stranger", "127.9.0.4", {"app": "epp"})
PODS = [ENGINE, EPP, OTHER, STRANGER]


def policy(ns, selector, ingress=None, types=None, egress=None):
    spec = {"podSelector": selector}
    if ingress is not None:
        spec["ingress"] = ingress
    if types is not None:
        spec["policyTypes"] = types
    if egress is not None:
        spec["egress"] = egress
    return {"metadata": {"namespace": ns, "name": f"p{id(spec)}"}, "spec": spec}


def admitted(policies, dest, source, protocol="TCP", port=5557) -> bool:
    """Whether the isolations say `source` may open `dest`:`port` (what the ruleset enforces)."""
    isos = {i.pod.key: i for i in netpol.ingress_isolations(policies, PODS, NAMESPACES)}
    iso = isos.get(dest.key)
    if iso is None or source.key == dest.key:
        return True
    for a in iso.allowances:
        if a.sources is not None and source.key not in a.sources:
            continue
        if a.ports is None or any(r.protocol == protocol and (r.first is None or r.first <= port <= r.last)
                                  for r in a.ports):
            return True
    return False


def test_selection_and_isolation():
    # No policy: nothing isolated. A policy selecting the engine with no ingress rules: deny all to it alone.
    assert netpol.ingress_isolations([], PODS, NAMESPACES) == []
    deny = policy(A, {"matchLabels": {"app": "engine"}})
    assert not admitted([deny], ENGINE, EPP) and admitted([deny], EPP, OTHER)
    # An empty podSelector selects every pod of its namespace only.
    deny_all = policy(A, {})
    assert {i.pod.name for i in netpol.ingress_isolations([deny_all], PODS, NAMESPACES)} == {"engine", "epp", "other"}
    # An egress-only policy does not isolate for ingress (and is reported as not enforced).
    egress_only = policy(A, {}, types=["Egress"], egress=[{}])
    assert netpol.ingress_isolations([egress_only], PODS, NAMESPACES) == []
    assert netpol.egress_ignored([egress_only, deny]) == [f"{A}/{egress_only['metadata']['name']}"]
    # A pod always reaches itself.
    assert admitted([deny], ENGINE, ENGINE)


def test_peers_ports_and_union():
    from_epp = policy(A, {"matchLabels": {"app": "engine"}}, [
        {"from": [{"podSelector": {"matchLabels": {"app": "epp"}}}], "ports": [{"port": 5557}, {"port": 5558}]}])
    assert admitted([from_epp], ENGINE, EPP, port=5557) and admitted([from_epp], ENGINE, EPP, port=5558)
    assert not admitted([from_epp], ENGINE, EPP, port=8000)
    assert not admitted([from_epp], ENGINE, EPP, protocol="UDP")
    assert not admitted([from_epp], ENGINE, OTHER)
    # podSelector alone means the policy's namespace: the same labels in another namespace do not count.
    assert not admitted([from_epp], ENGINE, STRANGER)
    # namespaceSelector alone: every pod of those namespaces; with a podSelector: both must hold.
    by_ns = policy(A, {"matchLabels": {"app": "engine"}}, [
        {"from": [{"namespaceSelector": {"matchExpressions": [{"key": "tier", "operator": "DoesNotExist"}]}}]}])
    assert admitted([by_ns], ENGINE, STRANGER, port=1) and not admitted([by_ns], ENGINE, EPP)
    both = policy(A, {"matchLabels": {"app": "engine"}}, [{"from": [{
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": B}},
        "podSelector": {"matchExpressions": [{"key": "app", "operator": "In", "values": ["web"]}]}}]}])
    assert not admitted([both], ENGINE, STRANGER)
    # Policies add up; an empty `from` admits everyone on its ports; named ports resolve on the destination.
    open_kv = policy(A, {"matchLabels": {"app": "engine"}}, [{"ports": [{"port": "kv"}]}])
    assert admitted([from_epp, open_kv], ENGINE, OTHER, port=5557)
    assert not admitted([from_epp, open_kv], ENGINE, OTHER, port=5558)
    # ipBlock peers match pods by address, less the exceptions; endPort spans a range.
    block = policy(A, {"matchLabels": {"app": "engine"}}, [{
        "from": [{"ipBlock": {"cidr": "127.9.0.0/30", "except": ["127.9.0.3/32"]}}],
        "ports": [{"port": 7000, "endPort": 7010}]}])
    assert admitted([block], ENGINE, EPP, port=7005) and not admitted([block], ENGINE, EPP, port=7011)
    assert not admitted([block], ENGINE, OTHER, port=7005) and not admitted([block], ENGINE, STRANGER, port=7005)


def test_ruleset_names_every_pod_by_cgroup():
    from_epp = policy(A, {"matchLabels": {"app": "engine"}}, [
        {"from": [{"podSelector": {"matchLabels": {"app": "epp"}}}], "ports": [{"port": 5557}]}])
    isos = netpol.ingress_isolations([from_epp], PODS, NAMESPACES)
    text = netpol.render_ruleset("k8srig_t", isos, {p.key: p for p in PODS}, pod_level=2, rig_cgroup="rig")
    assert text.startswith("table inet k8srig_t {}\ndelete table inet k8srig_t\n")   # one atomic replace
    assert "ip daddr 127.9.0.1 jump to_0" in text
    assert 'meta l4proto tcp th dport 5557 socket cgroupv2 level 2 { "rig/pod-epp" } accept' in text
    assert 'meta l4proto tcp socket cgroupv2 level 1 "rig" reject with tcp reset' in text
    with pytest.raises(ValueError):
        netpol.render_ruleset("t", isos, {p.key: netpol.PodInfo(p.namespace, p.name, p.ip, 'a"b') for p in PODS},
                              pod_level=2, rig_cgroup="rig")


# --- the kernel enforces it ----------------------------------------------------------------------------------

CLIENT = textwrap.dedent("""
    import socket, sys
    ok = []
    for port in map(int, sys.argv[2:]):
        try:
            socket.create_connection((sys.argv[1], port), timeout=3).close()
            ok.append("open")
        except OSError as e:
            ok.append(type(e).__name__)
    print(" ".join(ok))
""")


def _listen(ip: str) -> tuple[list[socket.socket], list[int]]:
    socks, ports = [], []
    for _ in range(2):
        s = socket.socket()
        s.bind((ip, 0))
        s.listen(16)
        socks.append(s)
        ports.append(s.getsockname()[1])
    return socks, ports


def _accept_forever(s: socket.socket) -> None:
    while True:
        try:
            conn, _ = s.accept()
        except OSError:
            return
        conn.close()


def test_nftables_enforces_the_policy_by_cgroup(tmp_path):
    nft = podnet.find_nft()
    reason = podnet.unavailable(nft)
    if reason is not None:
        pytest.skip(f"NetworkPolicy enforcement unavailable here: {reason}")
    rig_id = f"unit{tmp_path.name[-6:]}"
    cgroups = podnet.PodCgroups(rig_id)
    ip = "127.250.0.1"
    socks, (kv_port, http_port) = _listen(ip)
    for s in socks:
        threading.Thread(target=_accept_forever, args=(s,), daemon=True).start()
    try:
        dirs = {name: cgroups.create(name) for name in ("engine", "epp", "other")}
        pods = [netpol.PodInfo(A, name, "127.250.0.%d" % (i + 1), cgroups.nft_path(d), {"app": name})
                for i, (name, d) in enumerate(dirs.items())]
        policies = [policy(A, {"matchLabels": {"app": "engine"}}, [
            {"from": [{"podSelector": {"matchLabels": {"app": "epp"}}}], "ports": [{"port": kv_port}]}])]
        text = netpol.render_ruleset(podnet.table_name(rig_id), netpol.ingress_isolations(policies, pods, NAMESPACES),
                                     {p.key: p for p in pods}, pod_level=cgroups.pod_level,
                                     rig_cgroup=cgroups.rig_nft_path)
        podnet._nft(nft, text)

        def attempt(who: str | None) -> list[str]:
            argv = [sys.executable, "-c", CLIENT, ip, str(kv_port), str(http_port)]
            if who is not None:
                argv = cgroups.wrap(argv, dirs[who])
            return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True).stdout.split()

        assert attempt("epp") == ["open", "ConnectionRefusedError"]          # its port, not the other
        assert attempt("other") == ["ConnectionRefusedError", "ConnectionRefusedError"]
        assert attempt(None) == ["open", "open"]                             # the node: always
        podnet._nft(nft, netpol.render_ruleset(podnet.table_name(rig_id), [], {}, pod_level=cgroups.pod_level,
                                               rig_cgroup=cgroups.rig_nft_path))
        assert attempt("other") == ["open", "open"]                          # the policy gone: open again
    finally:
        for s in socks:
            s.close()
        podnet.cleanup(rig_id, nft)
    assert podnet.leftovers(rig_id) == []
