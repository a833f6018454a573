"""Where the EPP finds each endpoint's KV events: flags in standalone mode, pod annotations in Kubernetes mode;
bad values are clear errors."""

from __future__ import annotations

import subprocess

import pytest

from kvgate.epp.datastore import pool_endpoints
from kvgate.epp.kv_events.sources import EventSource, event_source
from kvgate.common.epp_protocol import (KV_EVENTS_PORT_ANNOTATION, KV_EVENTS_REPLAY_PORT_ANNOTATION,
                                 KV_EVENTS_TOPIC_ANNOTATION)
from kvgate.epp.types import Endpoint
from tests.procs import KVGATE
from tests.builders import pod

POOL = {"metadata": {"namespace": "ns"}, "spec": {"selector": {"matchLabels": {"app": "llm"}},
                                                  "targetPorts": [{"number": 8000}]}}


def test_flags_name_the_ports_on_each_endpoint_ip():
    assert event_source(Endpoint("10.0.0.1:8000"), 5557, 5558, "kv") == EventSource(
        "10.0.0.1:8000", "tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558", "kv")
    assert event_source(Endpoint("[fd00::1]:8000"), 5557, None, "") == EventSource(
        "[fd00::1]:8000", "tcp://[fd00::1]:5557", None, "")
    assert event_source(Endpoint("10.0.0.1:8000"), None, None, "") is None  # off unless asked for


def test_pod_annotations_override_the_flags_and_only_they_are_kept():
    pods = [pod("a", "10.0.0.1", annotations={"unrelated": "x", KV_EVENTS_PORT_ANNOTATION: "6000",
                                              KV_EVENTS_REPLAY_PORT_ANNOTATION: "6001",
                                              KV_EVENTS_TOPIC_ANNOTATION: "t"}),
            pod("b", "10.0.0.2", annotations={"unrelated": "x"}),
            pod("c", "10.0.0.3", annotations={"unrelated": "x", KV_EVENTS_PORT_ANNOTATION: "not-a-port"})]
    a, b, c = pool_endpoints(POOL, pods)
    assert dict(a.annotations) == {KV_EVENTS_PORT_ANNOTATION: "6000", KV_EVENTS_REPLAY_PORT_ANNOTATION: "6001",
                                   KV_EVENTS_TOPIC_ANNOTATION: "t"}
    assert event_source(a, 5557, None, "") == EventSource("10.0.0.1:8000", "tcp://10.0.0.1:6000",
                                                          "tcp://10.0.0.1:6001", "t")
    assert event_source(b, None, None, "") is None and b.annotations == {}
    assert event_source(c, 5557, None, "") is None  # logged; a typo never points the EPP elsewhere


@pytest.mark.processes
def test_bad_flags_are_one_line_errors(tmp_path):
    r = subprocess.run([KVGATE, "epp", "--endpoints", "127.0.0.1:1", "--kv-events-port", "70000"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "not a port number: '70000'" in r.stderr
    r = subprocess.run([KVGATE, "epp", "--endpoints", "127.0.0.1:1", "--tokenizer", str(tmp_path / "none")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "kvgate epp: --tokenizer: cannot load a tokenizer" in r.stderr, r.stderr
