"""Pure translations: endpoint lists, InferencePool + pods -> endpoints, objectives and rewrites."""

import logging
import os
import random
import time

import pytest
import yaml

from kvgate.epp.datastore import (Datastore, EndpointsFile, parse_endpoints, parse_endpoints_lines,
                                  parse_objectives, parse_rewrites, pool_endpoints)
from tests.builders import pod


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


def age(path, seconds=10.0):
    """Make the file look written `seconds` ago (settled)."""
    t = time.time() - seconds
    os.utime(path, (t, t))


class Watched:
    def __init__(self, path, **kw):
        self.store = Datastore()
        self.seen = []
        self.store.listeners.append(lambda eps: self.seen.append([e.address for e in eps]))
        self.file = EndpointsFile(path, self.store, **kw)

    def poll(self):
        return self.file.poll()

    @property
    def current(self):
        return [e.address for e in self.store.endpoints]


def test_endpoints_file_reloads_on_change(tmp_path):
    f = tmp_path / "eps"
    f.write_text("127.0.0.1:1")
    age(f)
    w = Watched(f)
    assert w.poll() and not w.poll()  # unchanged: no new notification
    f.write_text("127.0.0.1:1,127.0.0.1:2")
    age(f, 5)
    assert w.poll()
    assert w.seen == [["127.0.0.1:1"], ["127.0.0.1:1", "127.0.0.1:2"]] and w.store.synced


def test_parse_endpoints_lines_reports_and_skips_bad_lines():
    text = "127.0.0.1:8000  # replica a\n# a comment\n\nlocalhost:80\n127.0.0.2:1, 127.0.0.3:1\n127.0.0.1:8000\n"
    endpoints, problems = parse_endpoints_lines(text)
    assert [e.address for e in endpoints] == ["127.0.0.1:8000", "127.0.0.2:1", "127.0.0.3:1"]
    assert [n for n, _ in problems] == [4, 6]
    assert "localhost" in problems[0][1] and "twice" in problems[1][1]


def test_bad_line_is_logged_with_file_and_line_and_skipped(tmp_path, caplog):
    f = tmp_path / "eps"
    f.write_text("127.0.0.1:1  # replica a\n127.0.0.1:http\n127.0.0.1:2\n")
    age(f)
    w = Watched(f)
    with caplog.at_level(logging.WARNING, logger="kvgate.epp.datastore"):
        assert w.poll()
        w.poll()
        w.poll()
    assert w.current == ["127.0.0.1:1", "127.0.0.1:2"]
    bad = [r.getMessage() for r in caplog.records]
    assert len(bad) == 1 and f"{f}:2:" in bad[0] and "127.0.0.1:http" in bad[0]  # once, not every poll


def test_all_entries_bad_keeps_the_last_good_set(tmp_path, caplog):
    f = tmp_path / "eps"
    f.write_text("127.0.0.1:1\n")
    age(f)
    w = Watched(f)
    w.poll()
    f.write_text("127.0.0.1\n")  # the port got lost
    age(f)
    with caplog.at_level(logging.WARNING, logger="kvgate.epp.datastore"):
        assert not w.poll()
    assert w.current == ["127.0.0.1:1"]
    assert any("keeping the last good set of 1" in r.getMessage() for r in caplog.records)


def test_an_empty_file_drains_the_pool(tmp_path):
    f = tmp_path / "eps"
    f.write_text("127.0.0.1:1\n")
    age(f)
    w = Watched(f)
    w.poll()
    f.write_text("# drained for maintenance\n")
    age(f)
    assert w.poll() and w.current == [] and w.store.synced


def test_a_fresh_file_is_used_only_once_it_settles(tmp_path):
    f = tmp_path / "eps"
    f.write_text("127.0.0.1:1\n127.0.0.1:2\n")
    age(f)
    w = Watched(f)
    w.poll()
    f.write_text("127.0.0.1:3\n127.0.")  # an in-place writer caught half-way: mtime is now
    assert not w.poll() and w.current == ["127.0.0.1:1", "127.0.0.1:2"]
    f.write_text("127.0.0.1:3\n127.0.0.1:4\n")  # the writer finished
    assert not w.poll()  # still fresh and not yet seen twice
    assert w.poll()  # the same bytes at the next poll: complete
    assert w.current == ["127.0.0.1:3", "127.0.0.1:4"]
    assert w.seen == [["127.0.0.1:1", "127.0.0.1:2"], ["127.0.0.1:3", "127.0.0.1:4"]]  # never the partial set


def test_a_settled_file_is_used_at_once(tmp_path):
    f = tmp_path / "eps"
    f.write_text("127.0.0.1:1\n")
    w = Watched(f, settle=0.05)
    time.sleep(0.1)
    assert w.poll() and w.current == ["127.0.0.1:1"]


def test_atomic_rename_is_picked_up(tmp_path):
    f = tmp_path / "eps"
    f.write_text("127.0.0.1:1\n")
    age(f)
    w = Watched(f)
    w.poll()
    tmp = tmp_path / ".eps.tmp"
    tmp.write_text("127.0.0.1:5\n")
    age(tmp)
    os.replace(tmp, f)
    assert w.poll() and w.current == ["127.0.0.1:5"]


def test_a_file_changing_while_read_is_not_used(tmp_path):
    f = tmp_path / "eps"
    f.write_text("127.0.0.1:1\n")
    age(f)

    class WrittenDuringRead(EndpointsFile):
        """The writer appends between the fstat before and the one after the read."""

        def _read(self):
            real_fstat = os.fstat
            calls = []

            def fstat(fd):
                calls.append(fd)
                if len(calls) == 2:
                    with open(f, "a") as out:
                        out.write("127.0.0.1:2\n")
                return real_fstat(fd)

            os.fstat = fstat
            try:
                return super()._read()
            finally:
                os.fstat = real_fstat

    store = Datastore()
    assert not WrittenDuringRead(f, store).poll() and not store.synced


@pytest.mark.parametrize("problem", ["missing", "directory", "not-utf8", "too-large", "unreadable"])
def test_unreadable_file_keeps_the_last_good_set_and_logs_once(tmp_path, caplog, problem):
    f = tmp_path / "eps"
    f.write_text("127.0.0.1:1\n")
    age(f)
    w = Watched(f)
    assert w.poll()
    if problem == "missing":
        f.unlink()
    elif problem == "directory":
        f.unlink()
        f.mkdir()
    elif problem == "not-utf8":
        f.write_bytes(b"127.0.0.1:2\n\xff\xfe\n")
        age(f)
    elif problem == "too-large":
        f.write_text("# padding\n" * (EndpointsFile.MAX_BYTES // 10 + 1))
        age(f)
    else:
        if os.geteuid() == 0:
            pytest.skip("root reads files whatever their mode")
        f.chmod(0)
    with caplog.at_level(logging.WARNING, logger="kvgate.epp.datastore"):
        for _ in range(5):
            assert not w.poll()
    assert w.current == ["127.0.0.1:1"] and w.seen == [["127.0.0.1:1"]]
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and str(f) in messages[0] and "keeping the last good set of 1" in messages[0], messages


def test_recovers_after_the_file_comes_back(tmp_path, caplog):
    f = tmp_path / "eps"
    f.write_text("127.0.0.1:1\n")
    age(f)
    w = Watched(f)
    w.poll()
    f.unlink()
    w.poll()
    f.write_text("127.0.0.1:1\n")  # the same content again: nothing to install, the problem is over
    age(f)
    w.poll()
    f.unlink()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvgate.epp.datastore"):
        w.poll()  # a new problem after recovery: logged again
    assert len(caplog.records) == 1
    f.write_text("127.0.0.1:7\n")
    age(f)
    assert w.poll() and w.current == ["127.0.0.1:7"]


def test_missing_at_start_is_not_ready_and_not_fatal(tmp_path):
    w = Watched(tmp_path / "nope")
    assert not w.poll() and not w.store.synced
