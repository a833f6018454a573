"""`make test`'s scheduling of the suite over pytest-xdist workers (tests/conftest.py): what stays together on one
worker, and the recorded durations that start the longest units first."""

import json
from collections import OrderedDict
from pathlib import Path

import pytest

from tests import conftest

ROOT = Path(__file__).resolve().parents[1]


def test_a_file_is_one_unit_and_the_whole_e2e_tier_is_one():
    e2e = "tests/e2e/"
    assert conftest._unit("tests/e2e/test_rollout_e2e.py::test_rollouts_under_streaming_load", e2e) == e2e
    assert conftest._unit("tests/e2e/k8srig/x.py::test_y[a-b]", e2e) == e2e
    assert conftest._unit("tests/epp/test_config.py::TestX::test_y[1]", e2e) == "tests/epp/test_config.py"
    assert conftest._unit("tests/test_chaos.py::test_the_epp_going_away", e2e) == "tests/test_chaos.py"


def test_the_scheduler_hands_out_the_longest_units_first(monkeypatch, tmp_path):
    xdist = pytest.importorskip("xdist.scheduler")
    durations = tmp_path / "d.json"
    durations.write_text(json.dumps({"seconds": {"tests/e2e/": 900, "tests/test_chaos.py": 250}}))
    monkeypatch.setattr(conftest, "FILE_DURATIONS", durations)

    class Config:
        rootpath = ROOT

        class option:
            loadscopereorder = True

        @staticmethod
        def getvalue(name):
            return {"dist": "loadfile", "tx": ["2*popen"]}[name]

    sched = conftest.pytest_xdist_make_scheduler(Config, None)
    assert isinstance(sched, xdist.LoadFileScheduling)
    ids = ["tests/test_crds.py::a", "tests/test_crds.py::b", "tests/test_chaos.py::c", "tests/e2e/test_x.py::d",
           "tests/e2e/k8srig/test_y.py::e", "tests/test_new.py::f", "tests/test_new.py::g", "tests/test_new.py::h"]
    sched.workqueue = OrderedDict()
    for nodeid in ids:
        sched.workqueue.setdefault(sched._split_scope(nodeid), {})[nodeid] = False
    handed = []

    class Node:
        def send_runtest_some(self, indexes):
            handed.append(sorted({ids[i].split("::")[0] for i in indexes}))

    node = Node()
    sched.registered_collections = {node: ids}
    while sched.workqueue:
        sched._assign_work_unit(node)
    # recorded seconds first (longest first), then the rest by test count (1 s a test)
    assert handed == [["tests/e2e/k8srig/test_y.py", "tests/e2e/test_x.py"], ["tests/test_chaos.py"],
                      ["tests/test_new.py"], ["tests/test_crds.py"]]
    assert conftest.pytest_xdist_make_scheduler(type("C", (Config,), {"getvalue": staticmethod(
        lambda name: "load")}), None) is None  # other --dist modes are xdist's own
