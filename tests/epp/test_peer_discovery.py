"""Active-active peers found in Kubernetes (epp/peer_discovery.py): which pods are peers, the selector flag, and
peer sync following a changing peer list over real ZeroMQ sockets (PeerSync.set_peers). The pod watch against a
real API server: tests/e2e/test_epp_active_active_e2e.py."""

from __future__ import annotations

import argparse
import asyncio
import time

import pytest

from kvgate.common.processes import free_port
from kvgate.epp.peer_discovery import check_selector, peer_addresses
from kvgate.epp.peer_sync import PeerSync
from kvgate.epp.peer_sync_keys import PeerSyncKeyError, load_pool_key, new_pool_key_text
from tests.epp.test_peer_sync import replica


def pod(name, ip, phase="Running", deleting=False):
    meta = {"name": name, **({"deletionTimestamp": "2026-01-01T00:00:00Z"} if deleting else {})}
    return {"metadata": meta, "status": {"phase": phase, **({"podIP": ip} if ip else {})}}


def test_peers_are_the_running_pods_but_this_one():
    pods = {p["metadata"]["name"]: p for p in (
        pod("epp-a", "10.0.0.1"), pod("epp-b", "10.0.0.2"), pod("epp-c", "10.0.0.3", phase="Pending"),
        pod("epp-d", None), pod("epp-e", "10.0.0.5", deleting=True), pod("epp-f", "fd00::6"))}
    assert peer_addresses(pods, 9004, "epp-a", None) == ["tcp://10.0.0.2:9004", "tcp://[fd00::6]:9004"]
    assert peer_addresses(pods, 9004, None, "10.0.0.2") == ["tcp://10.0.0.1:9004", "tcp://[fd00::6]:9004"]


def test_the_selector_flag_takes_label_equalities_only():
    assert check_selector("app.kubernetes.io/name=kvgate-epp,app.kubernetes.io/instance=p") is not None
    for bad in ("", "a", "a!=b", "a in (b)", "a=b,,c=d", "a=" + "x" * 600, "a=b c"):
        with pytest.raises(ValueError):
            check_selector(bad)


def test_discovery_needs_a_bind_and_kubernetes_mode():
    from kvgate.epp.main import peer_sync_key

    args = argparse.Namespace(peer_sync_bind=None, peer_sync_peer=[], peer_sync_key_file=None,
                              peer_sync_insecure=False, peer_sync_discover_pods="a=b", pool_name=None)
    with pytest.raises(PeerSyncKeyError, match="needs --peer-sync-bind and Kubernetes mode"):
        peer_sync_key(args)


def test_the_operators_key_text_is_a_pool_key(tmp_path):
    path = tmp_path / "pool.key"
    path.write_text(new_pool_key_text())
    key = load_pool_key(path)
    assert len(key.public) == len(key.secret) == 40
    assert new_pool_key_text() != new_pool_key_text()


def test_peer_sync_follows_a_changing_peer_list(tmp_path):
    path = tmp_path / "pool.key"
    path.write_text(new_pool_key_text())
    key = load_pool_key(path)

    async def main():
        a, b = replica(), replica()
        binds = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
        a.peers = PeerSync(a, binds[0], [], key=key, heartbeat_s=0.05, peer_timeout_s=0.5)
        b.peers = PeerSync(b, binds[1], [], key=key, heartbeat_s=0.05, peer_timeout_s=0.5)
        a.peers.start()
        b.peers.start()

        async def until(check, what):
            deadline = time.monotonic() + 15
            while not check():
                assert time.monotonic() < deadline, what
                await asyncio.sleep(0.02)
                a.peers.expire()
                b.peers.expire()
        try:
            await asyncio.sleep(0.3)
            assert a.peers.stats()["peers"] == b.peers.stats()["peers"] == 0  # nobody known, nobody heard
            a.peers.set_peers([binds[1]])
            b.peers.set_peers([binds[0], binds[0]])  # duplicates once
            assert b.peers.peers == [binds[0]]
            await until(lambda: a.peers.stats()["peers"] == 1 and b.peers.stats()["peers"] == 1, "heartbeats")
            b.peers.set_peers([])  # a's pod is gone: b stops listening to it and forgets it after the timeout
            await until(lambda: b.peers.stats()["peers"] == 0, "a forgotten")
            assert a.peers.stats()["peers"] == 1  # a still hears b
        finally:
            a.peers.close()
            b.peers.close()

    asyncio.run(main())
