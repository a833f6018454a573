import pytest

from tests.procs import KvgateServe


@pytest.fixture(scope="session")
def kvgate_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("kvgate-cache")


@pytest.fixture(scope="module")
def demo_server(kvgate_cache):
    with KvgateServe("demo", "--max-model-len", "1024", "--engine-loop", "thread",
                     cache_dir=kvgate_cache) as server:
        yield server


@pytest.fixture(scope="module")
def sim_server(kvgate_cache):
    # a small KV pool so usage moves visibly under load
    with KvgateServe("sim-8b", "--backend", "sim", "--kv-cache-memory", str(64 * 1024 * 128 * 1024),
                     "--sim-max-model-len", "16384", cache_dir=kvgate_cache) as server:
        yield server
