import os

import pytest

from tests.engine.tiny_models import FAMILIES


@pytest.fixture(scope="session", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(autouse=True)
def _test_device(monkeypatch):
    """KVGATE_TEST_DEVICE=cuda runs the engine suites on the GPU (float32, so parity with HF stays token-exact);
    see test_cuda.py. Unset (CI): the engine's own default, the CPU."""
    device = os.environ.get("KVGATE_TEST_DEVICE")
    if not device:
        yield
        return
    from kvgate.engine import llm as llm_module

    make = llm_module.EngineConfig

    def on_device(*args, **kwargs):
        kwargs.setdefault("device", device)
        kwargs.setdefault("dtype", "float32")
        # A fixed KV cache instead of 90% of the card: engines of module fixtures live beside the tests' own
        # (the memory profile itself runs in test_cuda.py and the bench).
        if "num_gpu_blocks_override" not in kwargs:
            kwargs.setdefault("kv_cache_memory", 2 << 30)
        return make(*args, **kwargs)

    monkeypatch.setattr(llm_module, "EngineConfig", on_device)
    yield
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()
