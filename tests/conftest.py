import os

import pytest

# Tests share two cores with engine processes and the e2e rig; keep torch from oversubscribing them.
os.environ.setdefault("OMP_NUM_THREADS", "2")


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
