import pytest

from tests.engine.tiny_models import FAMILIES, build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """family -> (folder, HF model): built once per test session."""
    cache: dict = {}

    def get(family: str):
        if family not in cache:
            folder = tmp_path_factory.mktemp(f"tiny-{family}")
            cache[family] = (folder, build_tiny_model(family, folder))
        return cache[family]

    return get


@pytest.fixture(scope="session", params=FAMILIES)
def family(request):
    return request.param
