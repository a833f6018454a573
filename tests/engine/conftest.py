import pytest

from tests.engine.tiny_models import FAMILIES


@pytest.fixture(scope="session", params=FAMILIES)
def family(request):
    return request.param
