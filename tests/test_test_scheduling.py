"""`make test`'s scheduling of the suite over pytest-xdist workers (tests/conftest.py): what stays together on one
worker."""

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


def test_the_scheduler_keeps_each_file_and_the_e2e_tier_on_one_worker():
    xdist = pytest.importorskip("xdist.scheduler")

    class Config:
        rootpath = ROOT

        class option:
            loadscopereorder = True

        @staticmethod
        def getvalue(name):
            return {"dist": "loadfile", "tx": ["2*popen"]}[name]

    sched = conftest.pytest_xdist_make_scheduler(Config, None)
    assert isinstance(sched, xdist.LoadFileScheduling)
    assert sched._split_scope("tests/e2e/k8srig/test_y.py::e") == sched._split_scope("tests/e2e/test_x.py::d")
    assert sched._split_scope("tests/test_chaos.py::c") == "tests/test_chaos.py"
    assert conftest.pytest_xdist_make_scheduler(type("C", (Config,), {"getvalue": staticmethod(
        lambda name: "load")}), None) is None  # other --dist modes are xdist's own
