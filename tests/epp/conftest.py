import pytest

from tests.epp.kv_events_helpers import Harness


@pytest.fixture
def harness():
    """A precise scorer with its subscriber thread (kv_events_helpers.Harness), closed after the test."""
    h = Harness()
    yield h
    h.close()
