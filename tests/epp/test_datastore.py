"""Pure translations: endpoint lists, InferencePool + pods -> endpoints, objectives and rewrites."""

import random

import pytest
import yaml

from kvgate.epp.datastore import (Datastore, EndpointsFile, parse_endpoints, parse_objectives, parse_rewrites,
                                  pool_endpoints)


def pod(name, ip, labels, ready=True, phase="Running", namespace="ns", deleting=False):
    meta = {"name": name, "namespace": namespace, "labels": labels}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"podIP": ip, "phase": phase, "conditions": [
        {"type": "Ready", "status": "True" if ready else "False"}]}}


POOL = {"metadata": {"name": "p", "namespace": "ns"},
        "spec": {"selector": {"matchLabels": {"app": "llm"}}, "targetPorts": [{"number": 8000}, {"number": 8001}]}}


def test_pool_endpoints_each_ready_pod_times_each_port():
    pods = [
        pod("a", "10.0.0.1", {"app": "llm"}),
        pod("b", "10.0.0.2", {"app": "llm", "inference.networking.k8s.io/engine-type": "sglang"}),
        pod("not-ready", "10.0.0.3", {"app": "llm"}, ready=False),
        pod("pending", "10.0.0.4", {"app": "llm"}, phase="Pending"),
        pod("other-app", "10.0.0.5", {"app": "web"}),
        pod("no-ip", "", {"app": "llm"}),
        pod("deleting", "10.0.0.6", {"app": "llm"}, deleting=True),
        pod("other-ns", "10.0.0.7", {"app": "llm"}, namespace="elsewhere"),
        pod("v6", "fd00::1", {"app": "llm"}),
    ]
    eps = pool_endpoints(POOL, pods)
    assert [e.address for e in eps] == ["10.0.0.1:8000", "10.0.0.1:8001", "10.0.0.2:8000", "10.0.0.2:8001",
                                        "[fd00::1]:8000", "[fd00::1]:8001"]
    assert {e.engine_type for e in eps if e.name == "b"} == {"sglang"}
    assert {e.engine_type for e in eps if e.name == "a"} == {"vllm"}


def test_pool_without_selector_or_ports_has_no_endpoints():
    assert pool_endpoints({"spec": {"targetPorts": [{"number": 1}]}}, [pod("a", "1.1.1.1", {})]) == []
    assert pool_endpoints({"spec": {"selector": {"matchLabels": {"a": "b"}}}}, [pod("a", "1.1.1.1", {"a": "b"})]) == []


def test_parse_endpoints():
    assert [e.address for e in parse_endpoints("127.0.0.1:1, 127.0.0.2:2\n# comment\n[::1]:3")] == \
        ["127.0.0.1:1", "127.0.0.2:2", "[::1]:3"]
    for bad in ("localhost:80", "1.2.3.4", "1.2.3.4:0", "1.2.3.4:99999", "1.2.3.4:http"):
        with pytest.raises(ValueError):
            parse_endpoints(bad)


def test_objectives_and_rewrites():
    docs = list(yaml.safe_load_all("""
kind: InferenceObjective
metadata: {name: batch}
spec: {priority: -1, poolRef: {name: p}}
---
kind: InferenceObjective
metadata: {name: other-pool}
spec: {priority: 5, poolRef: {name: q}}
---
kind: InferenceModelRewrite
metadata: {name: r}
spec:
  poolRef: {name: p}
  rules:
  - matches: [{model: {value: food}}]
    targets: [{modelRewrite: food-v1, weight: 90}, {modelRewrite: food-v2, weight: 10}]
"""))
    assert parse_objectives(docs, "p") == {"batch": -1}
    store = Datastore()
    store.set_policies(parse_objectives(docs, "p"), parse_rewrites(docs, "p"))
    assert store.priority("batch") == -1 and store.priority("unknown") == 0 and store.priority(None) == 0
    rng = random.Random(0)
    picks = [store.rewrite("food", rng) for _ in range(2000)]
    assert 0.85 < picks.count("food-v1") / 2000 < 0.95
    assert store.rewrite("drinks", rng) == "drinks"


def test_endpoints_file_reloads_on_change(tmp_path):
    f = tmp_path / "eps"
    f.write_text("127.0.0.1:1")
    store = Datastore()
    seen = []
    store.listeners.append(lambda eps: seen.append([e.address for e in eps]))
    watcher = EndpointsFile(f, store)
    watcher.poll()
    watcher.poll()  # unchanged: no new notification
    import os
    f.write_text("127.0.0.1:1,127.0.0.1:2")
    os.utime(f, (f.stat().st_atime, f.stat().st_mtime + 5))
    watcher.poll()
    assert seen == [["127.0.0.1:1"], ["127.0.0.1:1", "127.0.0.1:2"]] and store.synced
