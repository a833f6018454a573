import multiprocessing.process
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
E2E = TESTS / "e2e"

# Tests share the machine's cores with engine processes, the e2e rig and (under `make test`) the other
# pytest-xdist worker: keep torch from oversubscribing them.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
os.environ.setdefault("OMP_NUM_THREADS", str(max(1, min(2, len(os.sched_getaffinity(0)) // _WORKERS))))


def pytest_addoption(parser):
    parser.addoption(
        "--unit-lane", action="store_true",
        help="`make check`'s lane: starting a subprocess (subprocess.Popen, os.posix_spawn, os.fork, os.system, a "
             "multiprocessing process) fails the test with the marker it lacks (`processes`)")


class StartsProcesses(RuntimeError):
    """A test of the unit lane started a process."""


# Library probes that run a short helper to answer a question about this machine, not processes a test starts:
# ctypes.util.find_library asks ldconfig (the engine's allocator set-up looks up libc), platform asks uname.
_PROBES = (os.path.join("ctypes", "util.py"), os.sep + "platform.py")


def _refuse(what: str, real):
    def refuse(*args, **kwargs):
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_filename.endswith(_PROBES):
                return real(*args, **kwargs)
            frame = frame.f_back
        raise StartsProcesses(
            f"{what} under `make check` (--unit-lane): this test starts a process. Mark it "
            f"@pytest.mark.processes (or its file: pytestmark = pytest.mark.processes); `make test` runs it.")
    return refuse


@pytest.hookimpl(wrapper=True)
def pytest_runtestloop(session):
    """Under --unit-lane, while the tests run (fixtures included), every way to start a process raises
    StartsProcesses instead. Not around collection or pytest-xdist's own start-up (its controller starts the
    workers as processes; a worker reports platform.platform(), which asks `uname -p`); each worker gets the
    option and guards its own tests."""
    config = session.config
    if not config.getoption("unit_lane") or (config.getoption("numprocesses", None) and
                                             not hasattr(config, "workerinput")):
        return (yield)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess.Popen, "__init__", _refuse("subprocess.Popen", subprocess.Popen.__init__))
        for name in ("posix_spawn", "posix_spawnp", "fork", "forkpty", "system"):
            if hasattr(os, name):
                mp.setattr(os, name, _refuse(f"os.{name}", getattr(os, name)))
        process = multiprocessing.process.BaseProcess
        mp.setattr(process, "start", _refuse("multiprocessing's Process.start", process.start))
        return (yield)


def _unit(nodeid: str, e2e_prefix: str) -> str:
    """The scheduling unit of a test: its file, except that the whole e2e tier is one unit."""
    return e2e_prefix if nodeid.startswith(e2e_prefix) else nodeid.split("::", 1)[0]


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: without xdist installed, nothing calls it
def pytest_xdist_make_scheduler(config, log):
    """`make test` runs two pytest-xdist workers with `--dist loadfile`: a test file runs whole on one worker,
    so its module-scoped fixtures (engines, Envoys, the chaos run) start once. Here the e2e tier counts as one
    file, so a single worker builds and runs the session's Kubernetes rig and stops it after its last e2e test
    (tests/e2e/conftest.py). xdist hands out the units with the most tests first (handing out the longest first, by recorded
    durations, made the suite slower and a timing-based test fail under load).
    (xdist_group marks could say the same, but pytest 9.2 ignores the node-id suffix pytest-xdist 3.8 gives them.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    e2e = E2E.relative_to(config.rootpath).as_posix() + "/"

    class E2ETierAsOneFile(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid, e2e)

    return E2ETierAsOneFile(config, log)


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
