import os
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
E2E = TESTS / "e2e"

# Tests share the machine's cores with engine processes, the e2e rig and (under `make test`) the other
# pytest-xdist worker: keep torch from oversubscribing them.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
os.environ.setdefault("OMP_NUM_THREADS", str(max(1, min(2, len(os.sched_getaffinity(0)) // _WORKERS))))


def _unit(nodeid: str, e2e_prefix: str) -> str:
    """The scheduling unit of a test: its file, except that the whole e2e tier is one unit."""
    return e2e_prefix if nodeid.startswith(e2e_prefix) else nodeid.split("::", 1)[0]


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: without xdist installed, nothing calls it
def pytest_xdist_make_scheduler(config, log):
    """`make test` runs two pytest-xdist workers with `--dist loadfile`: a test file runs whole on one worker,
    so its module-scoped fixtures (engines, Envoys, the chaos run) start once. Here the e2e tier counts as one
    file, so a single worker builds and runs the session's Kubernetes rig and stops it after its last e2e test
    (tests/e2e/conftest.py). xdist hands out the units with the most tests first; longest-first by recorded
    durations was measured once and lost (39.0 min and a timing failure under load, against 34.0 min).
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
