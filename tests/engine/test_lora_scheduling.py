"""The engine's adapter bookkeeping, on the sim backend (real scheduler, KV blocks and events; no weights): slots,
a waiting adapter request that does not block others, removal while in use, cache namespaces per adapter, KV
events naming the adapter, and the errors a bad adapter gets."""

from __future__ import annotations

import json

import pytest

from kvgate.engine.config import EngineConfig
from kvgate.common.errors import ConfigError, LoRAError
from kvgate.engine.lora.request import LoRAModulePath, LoRARequest
from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.sim_runner import SimProfile

PROMPT = list(range(40, 40 + 48))  # three 16-token blocks


def adapter_dir(root, name: str, rank: int = 8) -> str:
    folder = root / name
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}))
    return str(folder)


def engine(tmp_path, **lora_args) -> LLMEngine:
    # A fast sim (no sleeping worth the name) so the tests step quickly.
    profile = SimProfile(step_overhead_ms=0.0, prefill_ms_per_token=0.0, decode_ms_per_seq=0.0,
                         ms_per_context_token=0.0, max_model_len=512)
    return LLMEngine(EngineConfig(model="sim", backend="sim", sim_profile=profile, num_gpu_blocks_override=64,
                                  enable_lora=True, **lora_args))


def run(e: LLMEngine, steps: int = 200) -> None:
    for _ in range(steps):
        if not e.has_unfinished_requests():
            return
        e.step()
    raise AssertionError("requests did not finish")


def params(n: int = 4) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def test_a_request_whose_adapter_has_no_slot_waits_without_blocking_others(tmp_path):
    e = engine(tmp_path, max_loras=1)
    a, b = LoRARequest("a", 1, adapter_dir(tmp_path, "a")), LoRARequest("b", 2, adapter_dir(tmp_path, "b"))
    e.add_lora(a)
    e.add_lora(b)
    e.add_request("a1", PROMPT, params(20), lora_request=a)
    e.step()  # a1 runs and holds the only slot
    e.add_request("b1", PROMPT, params(), lora_request=b)  # first in line, but no slot for b
    e.add_request("base", PROMPT, params())
    e.add_request("a2", PROMPT, params(), lora_request=a)
    e.step()
    running = {r.request_id for r in e.scheduler.running}
    assert running == {"a1", "base", "a2"} and [r.request_id for r in e.scheduler.waiting] == ["b1"]
    stats = e.stats()
    assert (stats.max_lora, stats.running_lora_adapters, stats.waiting_lora_adapters) == (1, ["a"], ["b"])
    run(e)  # once a's requests end, b gets the slot
    assert e.lora.slots == [2]


def test_remove_refuses_new_requests_and_lets_running_ones_finish(tmp_path):
    e = engine(tmp_path, max_loras=2)
    a = LoRARequest("a", 1, adapter_dir(tmp_path, "a"))
    e.add_lora(a)
    e.add_request("a1", PROMPT, params(8), lora_request=a)
    e.step()
    assert e.remove_lora("a") and not e.remove_lora("a")
    with pytest.raises(LoRAError, match="not loaded"):
        e.add_request("a2", PROMPT, params(), lora_request=a)
    assert e.lora.slot_of(1) is not None  # still serving a1
    outputs = []
    for _ in range(50):
        outputs += e.step()
        if not e.has_unfinished_requests():
            break
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 8
    e.step()
    assert e.lora.slot_of(1) is None and not e.lora.retired  # freed once a1 ended
    assert [lora.lora_name for lora in e.list_loras()] == []


def test_adapters_and_the_base_never_share_cached_blocks(tmp_path):
    e = engine(tmp_path, max_loras=2)
    a, b = LoRARequest("a", 1, adapter_dir(tmp_path, "a")), LoRARequest("b", 2, adapter_dir(tmp_path, "b"))
    e.add_lora(a)
    e.add_lora(b)
    e.kv_cache_manager.pool.kv_events = []
    cached = {}
    for rid, lora in (("base", None), ("a", a), ("b", b), ("a-again", a)):
        e.add_request(rid, PROMPT, params(1), lora_request=lora)
        run(e)
        cached[rid] = e.scheduler.num_preemptions, e.kv_cache_manager.prefix_stats.hits
    hits = [cached[r][1] for r in ("base", "a", "b", "a-again")]
    assert hits[:3] == [0, 0, 0] and hits[3] == 32  # only a's own blocks are reused (the last is recomputed)
    stored = [ev for ev in e.kv_cache_manager.pool.take_kv_events() if type(ev).__name__ == "BlockStored"]
    assert {(ev.lora_id, ev.lora_name) for ev in stored} == {(None, None), (1, "a"), (2, "b")}


def test_sim_adapters_write_their_own_tokens(tmp_path):
    e = engine(tmp_path, max_loras=2)
    a = LoRARequest("a", 1, adapter_dir(tmp_path, "a"))
    e.add_lora(a)
    out = {}
    for rid, lora in (("base", None), ("a", a)):
        e.add_request(rid, PROMPT, params(8), lora_request=lora)
        for o in iter(e.step, None):
            if o and o[-1].finished:
                out[rid] = o[-1].outputs[0].token_ids
                break
    assert out["base"] != out["a"]


@pytest.mark.parametrize("make, says", [
    (lambda root: str(root / "missing"), "does not exist"),
    (lambda root: adapter_dir(root, "big", rank=64), "greater than max_lora_rank 16"),
    (lambda root: (root / "empty").mkdir() or str(root / "empty"), "no adapter_config.json"),
])
def test_bad_adapters_are_lora_errors_and_change_nothing(tmp_path, make, says):
    e = engine(tmp_path)
    with pytest.raises(LoRAError, match=says):
        e.add_lora(LoRARequest("x", 1, make(tmp_path)))
    assert e.list_loras() == []
    e.add_lora(LoRARequest("x", 2, adapter_dir(tmp_path, "ok")))  # the name is still free; id 1 is not reused
    with pytest.raises(LoRAError, match="already loaded"):
        e.add_lora(LoRARequest("x", 3, adapter_dir(tmp_path, "ok2")))
    with pytest.raises(LoRAError, match="already used"):
        e.add_lora(LoRARequest("y", 2, adapter_dir(tmp_path, "ok3")))


def test_lora_off_and_bad_startup_modules(tmp_path):
    profile = SimProfile(max_model_len=512)
    plain = LLMEngine(EngineConfig(model="sim", backend="sim", sim_profile=profile, num_gpu_blocks_override=64))
    with pytest.raises(LoRAError, match="not enabled"):
        plain.add_lora(LoRARequest("a", 1, adapter_dir(tmp_path, "a")))
    with pytest.raises(ConfigError, match="--lora-modules bad="):
        engine(tmp_path, lora_modules=(LoRAModulePath("bad", str(tmp_path / "nowhere")),))
    good = engine(tmp_path, lora_modules=(LoRAModulePath("a", str(tmp_path / "a")),
                                          LoRAModulePath("b", adapter_dir(tmp_path, "b"))))
    assert [(lora.lora_name, lora.lora_int_id) for lora in good.list_loras()] == [("a", 1), ("b", 2)]


def test_an_adapter_that_no_longer_loads_fails_its_requests_not_the_engine(tmp_path):
    """One host copy for two adapters: a's is dropped when b is added; if a's folder is then gone, a's request
    gets the error (the server answers it; LLM.generate raises it) and the engine goes on serving b."""
    import shutil

    e = engine(tmp_path, max_loras=1, max_cpu_loras=1)
    a, b = LoRARequest("a", 1, adapter_dir(tmp_path, "a")), LoRARequest("b", 2, adapter_dir(tmp_path, "b"))
    e.add_lora(a)
    e.add_lora(b)
    shutil.rmtree(a.lora_path)
    e.add_request("for-a", PROMPT, params(), lora_request=a)
    e.add_request("for-b", PROMPT, params(), lora_request=b)
    e.step()
    (failure,) = e.take_failures()
    assert failure[0] == "for-a" and isinstance(failure[1], LoRAError) and "does not exist" in str(failure[1])
    run(e)
    assert not e.take_failures() and not e.has_unfinished_requests()
