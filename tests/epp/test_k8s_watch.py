"""Kubernetes mode's watch logic against a recording fake of the two kubernetes API objects it uses
(CoreV1Api, CustomObjectsApi): label-selected pod list and watch, resumed from the resourceVersion, re-listed
only on 410 Gone or a new selector, one event -> no API call, a timeout on every call.

The fake answers what the real API server would (the watch as a stream of JSON lines, read by the real
kubernetes.watch.Watch); the real control plane runs this in tests/e2e/test_epp_kubernetes.py."""

import json
import threading
import time

import pytest

from kvgate.epp.datastore import Datastore
from kvgate.epp.k8s_watch import (REQUEST_TIMEOUT, WATCH_TIMEOUT_S, PoolWatcher, apply_pod_event,
                                  label_selector)
from tests.builders import pod

NS = "ns"


def pool(selector=None, ports=(8000,)):
    return {"metadata": {"name": "p", "namespace": NS},
            "spec": {"selector": {"matchLabels": selector or {"app": "llm"}},
                     "targetPorts": [{"number": p} for p in ports]}}


class Body:
    def __init__(self, obj):
        self.data = json.dumps(obj).encode()


class WatchResponse:
    """What urllib3 hands kubernetes.watch for `watch=True, _preload_content=False`."""

    status = 200

    def __init__(self, events):
        self.events = events

    def stream(self, amt=None, decode_content=False):
        for e in self.events:
            yield (json.dumps(e) + "\n").encode()

    def close(self):
        pass

    def release_conn(self):
        pass


class FakeCore:
    def __init__(self):
        self.calls = []
        self.lists = []  # bodies for the next list calls
        self.watches = []  # event lists for the next watch calls

    def list_namespaced_pod(self, namespace, **kw):
        self.calls.append(("pods", namespace, kw))
        if kw.get("watch"):
            return WatchResponse(self.watches.pop(0))
        return Body(self.lists.pop(0))


class FakeCustom:
    def __init__(self, pool_obj):
        self.pool = pool_obj
        self.calls = []

    def get_namespaced_custom_object(self, group, version, namespace, plural, name, **kw):
        self.calls.append((plural, kw))
        return self.pool

    def list_namespaced_custom_object(self, group, version, namespace, plural, **kw):
        self.calls.append((plural, kw))
        return {"items": []}


@pytest.fixture
def fake():
    core, custom = FakeCore(), FakeCustom(pool())
    store = Datastore()
    watcher = PoolWatcher(store, "p", NS, core=core, custom=custom)
    return watcher, core, custom, store


def addresses(store):
    return [e.address for e in store.endpoints]


def test_label_selector_and_events_are_pure():
    assert label_selector(pool({"b": "2", "a": "1"})) == "a=1,b=2"
    assert label_selector({"spec": {}}) == ""
    pods = {}
    assert apply_pod_event(pods, {"type": "ADDED", "raw_object": pod("a", "10.0.0.1", rv="5")}) == "5"
    apply_pod_event(pods, {"type": "MODIFIED", "object": pod("a", "10.0.0.9", rv="6")})
    assert pods["a"]["status"]["podIP"] == "10.0.0.9"
    apply_pod_event(pods, {"type": "DELETED", "raw_object": pod("a", "10.0.0.9", rv="7")})
    assert pods == {}
    assert apply_pod_event(pods, {"type": "BOOKMARK", "raw_object": {"metadata": {"resourceVersion": "9"}}}) == "9"
    assert pods == {}


def test_list_then_watch_from_its_version_one_event_no_relist(fake):
    watcher, core, custom, store = fake
    watcher.sync_pool()
    assert [c[0] for c in custom.calls] == ["inferencepools", "inferenceobjectives", "inferencemodelrewrites"]
    assert all(kw["_request_timeout"] == REQUEST_TIMEOUT for _, kw in custom.calls)

    core.lists.append({"metadata": {"resourceVersion": "100"},
                       "items": [pod("a", "10.0.0.1", rv="90"), pod("b", "10.0.0.2", rv="95", ready=False)]})
    watcher.pod_watch_step()  # no cache yet: list
    (_, ns, kw), = core.calls
    assert ns == NS and kw["label_selector"] == "app=llm" and kw["_request_timeout"] == REQUEST_TIMEOUT
    assert not kw.get("watch") and addresses(store) == ["10.0.0.1:8000"] and store.synced

    core.watches.append([{"type": "MODIFIED", "object": pod("b", "10.0.0.2", rv="101")},
                         {"type": "ADDED", "object": pod("c", "10.0.0.3", rv="102")},
                         {"type": "BOOKMARK", "object": {"kind": "Pod", "metadata": {"resourceVersion": "150"}}}])
    seen = []
    store.listeners.append(lambda eps: seen.append([e.address for e in eps]))
    custom.calls.clear()
    watcher.pod_watch_step()  # a cache: watch
    _, _, kw = core.calls[1]
    assert kw["watch"] is True and kw["label_selector"] == "app=llm" and kw["resource_version"] == "100"
    assert kw["timeout_seconds"] == WATCH_TIMEOUT_S and kw["_request_timeout"][1] > WATCH_TIMEOUT_S
    assert kw["allow_watch_bookmarks"] is True
    # each event updated the endpoints at once, with no list of pods, pool or policies
    assert seen == [["10.0.0.1:8000", "10.0.0.2:8000"], ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]]
    assert len(core.calls) == 2 and custom.calls == []

    core.watches.append([])  # the server ended the watch after timeout_seconds: resumed, not re-listed
    watcher.pod_watch_step()
    assert core.calls[2][2]["resource_version"] == "150" and core.calls[2][2]["watch"]


def test_gone_relists_and_resumes_from_the_new_version(fake):
    watcher, core, custom, store = fake
    watcher.sync_pool()
    core.lists.append({"metadata": {"resourceVersion": "100"}, "items": [pod("a", "10.0.0.1", rv="90")]})
    watcher.pod_watch_step()
    core.watches.append([{"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired",
                                                      "message": "too old resource version: 100"}}])
    watcher.pod_watch_step()  # 410: the cache is dropped ...
    core.lists.append({"metadata": {"resourceVersion": "300"}, "items": [pod("z", "10.0.0.26", rv="299")]})
    watcher.pod_watch_step()  # ... and listed again
    assert [bool(kw.get("watch")) for _, _, kw in core.calls] == [False, True, False]
    assert addresses(store) == ["10.0.0.26:8000"]
    core.watches.append([])
    watcher.pod_watch_step()
    assert core.calls[-1][2]["resource_version"] == "300"


def test_a_new_selector_relists_with_it_and_new_ports_apply_at_once(fake):
    watcher, core, custom, store = fake
    watcher.sync_pool()
    core.lists.append({"metadata": {"resourceVersion": "1"}, "items": [pod("a", "10.0.0.1", rv="1")]})
    watcher.pod_watch_step()
    custom.pool = pool(ports=(8000, 8001))
    watcher.sync_pool()
    assert addresses(store) == ["10.0.0.1:8000", "10.0.0.1:8001"] and len(core.calls) == 1
    custom.pool = pool({"app": "other"})
    watcher.sync_pool()
    core.lists.append({"metadata": {"resourceVersion": "2"},
                       "items": [pod("o", "10.0.0.5", {"app": "other"}, rv="2")]})
    watcher.pod_watch_step()
    assert core.calls[-1][2]["label_selector"] == "app=other" and not core.calls[-1][2].get("watch")
    assert addresses(store) == ["10.0.0.5:8000"]


def test_a_pool_without_selector_lists_no_pods(fake):
    watcher, core, custom, store = fake
    custom.pool = {"metadata": {"name": "p"}, "spec": {"targetPorts": [{"number": 1}]}}
    watcher.resync = 0.01
    watcher.sync_pool()
    watcher.pod_watch_step()
    watcher.pod_watch_step()
    assert core.calls == [] and store.synced and store.endpoints == []


def test_threads_follow_events_and_stop(fake):
    """The two loops together: the first list, then events, then stop() ends both threads promptly."""
    watcher, core, custom, store = fake
    core.lists.append({"metadata": {"resourceVersion": "1"}, "items": [pod("a", "10.0.0.1", rv="1")]})
    core.watches.append([{"type": "ADDED", "object": pod("b", "10.0.0.2", rv="2")}])
    released = threading.Event()

    class Idle(WatchResponse):  # then a watch with no events until stopped
        def stream(self, amt=None, decode_content=False):
            released.wait(10)
            return iter(())

    orig = core.list_namespaced_pod

    def list_pods(namespace, **kw):
        if kw.get("watch") and not core.watches:
            core.calls.append(("pods", namespace, kw))
            return Idle([])
        return orig(namespace, **kw)

    core.list_namespaced_pod = list_pods
    watcher.start()
    try:
        deadline = time.monotonic() + 10
        while addresses(store) != ["10.0.0.1:8000", "10.0.0.2:8000"]:
            assert time.monotonic() < deadline, addresses(store)
            time.sleep(0.01)
    finally:
        watcher.stop()
        released.set()
        for t in watcher._threads:
            t.join(5)
    assert not any(t.is_alive() for t in watcher._threads)
    assert sum(1 for _, _, kw in core.calls if not kw.get("watch")) == 1  # listed once


class GoneResponse(WatchResponse):
    """The API server refusing the watch request itself with HTTP 410 (resourceVersion compacted away)."""

    status = 410
    reason = "Gone"
    data = json.dumps({"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"}).encode()

    headers = {"content-type": "application/json"}

    def __init__(self):
        super().__init__([])

    def getheader(self, name, default=None):
        return self.headers.get(name.lower(), default)


def test_a_watch_refused_with_410_relists_too(fake):
    """The other shape of 410: not an ERROR event in the stream but the watch request's own HTTP status (the
    kubernetes client raises ApiException(410)). Same outcome: the cache is dropped and listed again."""
    watcher, core, custom, store = fake
    watcher.sync_pool()
    core.lists.append({"metadata": {"resourceVersion": "100"}, "items": [pod("a", "10.0.0.1", rv="90")]})
    watcher.pod_watch_step()
    orig = core.list_namespaced_pod

    def gone_once(namespace, **kw):
        if kw.get("watch"):
            core.list_namespaced_pod = orig
            core.calls.append(("pods", namespace, kw))
            return GoneResponse()
        return orig(namespace, **kw)

    core.list_namespaced_pod = gone_once
    watcher.pod_watch_step()  # HTTP 410: dropped, no exception out of the step (so no error backoff either)
    core.lists.append({"metadata": {"resourceVersion": "300"}, "items": [pod("b", "10.0.0.2", rv="299")]})
    watcher.pod_watch_step()
    assert [bool(kw.get("watch")) for _, _, kw in core.calls] == [False, True, False]
    assert addresses(store) == ["10.0.0.2:8000"]
