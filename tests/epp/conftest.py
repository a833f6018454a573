import pytest

from tests.epp.kv_events_helpers import Harness


@pytest.fixture
def harness():
    """A precise scorer with its subscriber thread (kv_events_helpers.Harness), closed after the test."""
    h = Harness()
    yield h
    h.close()


@pytest.fixture(scope="module")
def module_cache_dir(tmp_path_factory):
    """KVGATE_CACHE_DIR in a fresh folder for a whole module (the byte tokenizer and demo files built there once)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("KVGATE_CACHE_DIR", str(tmp_path_factory.mktemp("kvgate-cache")))
    yield
    mp.undo()
