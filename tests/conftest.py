import os
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
E2E = TESTS / "e2e"

# Tests share the machine's cores with engine processes, the e2e rig and (under `make test`) the other
# pytest-xdist worker: keep torch from oversubscribing them.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
os.environ.setdefault("OMP_NUM_THREADS", str(max(1, min(2, len(os.sched_getaffinity(0)) // _WORKERS))))


# Seconds each scheduling unit (a test file, or the whole e2e tier) took in a full `make test`, so that the longest
# start first. Not committed: measured once, longest-first (39.0 min, one timing failure) lost to the default
# order, more tests first (34.0 min). Absent, or for a unit it lacks, a unit counts 1 s a test.
FILE_DURATIONS = TESTS / "file_durations.json"
_measured: dict[str, float] = {}


def pytest_addoption(parser):
    parser.addoption("--store-file-durations", action="store_true",
                     help=f"write each test file's total duration into {FILE_DURATIONS.name} (kvgate's scheduling)")


def _unit(nodeid: str, e2e_prefix: str) -> str:
    """The scheduling unit of a test: its file, except that the whole e2e tier is one unit."""
    return e2e_prefix if nodeid.startswith(e2e_prefix) else nodeid.split("::", 1)[0]


def _e2e_prefix(config) -> str:
    return E2E.relative_to(config.rootpath).as_posix() + "/"


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: without xdist installed, nothing calls it
def pytest_xdist_make_scheduler(config, log):
    """`make test` runs two pytest-xdist workers with `--dist loadfile`: a test file runs whole on one worker,
    so its module-scoped fixtures (engines, Envoys, the chaos run) start once. Here the e2e tier counts as one
    file, so a single worker builds and runs the session's Kubernetes rig and stops it after its last e2e test
    (tests/e2e/conftest.py); and the units go out longest first (FILE_DURATIONS). (xdist_group marks could say
    the first part, but pytest 9.2 ignores the node-id suffix pytest-xdist 3.8 gives them.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    import json
    from collections import OrderedDict

    from xdist.scheduler import LoadFileScheduling

    e2e = _e2e_prefix(config)
    known = json.loads(FILE_DURATIONS.read_text())["seconds"] if FILE_DURATIONS.is_file() else {}

    class LongestUnitsFirst(LoadFileScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid, e2e)

        def _assign_work_unit(self, node):
            if not self.ordered:  # the queue is complete by the first assignment
                self.ordered = True
                expected = {unit: known.get(unit, len(tests)) for unit, tests in self.workqueue.items()}
                self.workqueue = OrderedDict(sorted(self.workqueue.items(), key=lambda kv: -expected[kv[0]]))
            super()._assign_work_unit(node)

    return LongestUnitsFirst(config, log)


def pytest_runtest_logreport(report):  # every phase's report; xdist's controller gets its workers' too
    _measured[report.nodeid] = _measured.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session):
    config = session.config
    if not config.getoption("store_file_durations") or hasattr(config, "workerinput"):
        return
    import json

    e2e = _e2e_prefix(config)
    totals: dict[str, float] = {}
    for nodeid, seconds in _measured.items():
        totals[_unit(nodeid, e2e)] = totals.get(_unit(nodeid, e2e), 0.0) + seconds
    old = json.loads(FILE_DURATIONS.read_text())["seconds"] if FILE_DURATIONS.is_file() else {}
    merged = {**old, **{unit: round(s, 1) for unit, s in totals.items()}}  # a partial run updates its own units
    FILE_DURATIONS.write_text(json.dumps({
        "about": "seconds each unit of tests/conftest.py's scheduler took under `make test` (setup + call + "
                 "teardown of its tests); written by --store-file-durations, read to start the longest first",
        "seconds": dict(sorted(merged.items(), key=lambda kv: -kv[1]))}, indent=1) + "\n")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """family -> (folder, HF model) of tests/engine/tiny_models.py: built once per test session."""
    from tests.engine.tiny_models import build_tiny_model

    cache: dict = {}

    def get(family: str):
        if family not in cache:
            folder = tmp_path_factory.mktemp(f"tiny-{family}")
            cache[family] = (folder, build_tiny_model(family, folder))
        return cache[family]

    return get


@pytest.fixture
def zctx():
    """A ZeroMQ context of the test's own (the KV-event tests' sockets)."""
    import zmq

    ctx = zmq.Context()
    yield ctx
    ctx.term()  # every socket a test opened must be closed by then, or this hangs (and the test times out)
