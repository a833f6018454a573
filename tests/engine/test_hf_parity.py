"""Greedy outputs must be token-identical to HF transformers' own generate(), in every scheduling mode."""

import random

import pytest
import torch

from kvgate.engine import LLM, SamplingParams
from tests.engine.tiny_models import FAMILIES, MOE_FAMILIES, hf_greedy, hf_greedy_by_family

pytestmark = pytest.mark.slow

MAX_NEW = 24
PROMPT_LENGTHS = [3, 7, 15, 16, 17, 33, 48, 70, 5, 40]

MODES = {
    "prefix-caching": dict(enable_prefix_caching=True),
    "no-prefix-caching": dict(enable_prefix_caching=False),
    "chunked-prefill": dict(max_num_batched_tokens=16),
    "preemption": dict(num_gpu_blocks_override=12, max_num_seqs=16),
    # The next step scheduled before this one's tokens are taken (the default on CUDA; forced here on the CPU).
    "async-chunked-prefill": dict(async_scheduling=True, max_num_batched_tokens=16),
    "async-preemption": dict(async_scheduling=True, num_gpu_blocks_override=12, max_num_seqs=16),
}


def make_prompts() -> list[list[int]]:
    rng = random.Random(1234)
    shared = [rng.randrange(256) for _ in range(32)]  # two prompts share a 32-token (2-block) prefix
    prompts = [[rng.randrange(256) for _ in range(n)] for n in PROMPT_LENGTHS]
    prompts[6] = shared + prompts[6][:16]
    prompts[9] = shared + prompts[9][:8]
    return prompts


@pytest.fixture(scope="module")
def hf_reference(tiny_model_dir):
    return hf_greedy_by_family(tiny_model_dir, make_prompts(), MAX_NEW)


@pytest.mark.parametrize("family", FAMILIES + MOE_FAMILIES)
@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_hf(family, mode, tiny_model_dir, hf_reference):
    folder, _ = tiny_model_dir(family)
    check_greedy_parity(family, mode, folder, hf_reference(family))


def check_greedy_parity(family: str, mode: str, folder, expected: list[list[int]]) -> LLM:
    """The engine over make_prompts() in `mode` gives HF's greedy tokens `expected` (and leaves nothing behind);
    returns the engine."""
    llm = LLM(str(folder), max_model_len=128, **MODES[mode])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in make_prompts()], params)
    got = [o.outputs[0].token_ids for o in outs]
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"{family}/{mode}: prompt {i} (len {len(make_prompts()[i])}) diverges from HF"
    stats = llm.engine.stats()
    if mode.endswith("preemption"):
        assert stats.num_preemptions > 0, "the small KV pool should have forced preemption"
    if mode == "prefix-caching":
        # the second pass over the same prompts is served from the cache and still matches
        again = llm.generate([{"prompt_token_ids": p} for p in make_prompts()], params)
        assert [o.outputs[0].token_ids for o in again] == expected
        assert sum(o.num_cached_tokens for o in again) > 0
    assert stats.num_running == stats.num_waiting == 0
    assert stats.kv_cache_usage == 0.0
    return llm


def test_mistral_sliding_window_matches_hf(tmp_path):
    """Prompts longer than the window: both prefill masks and decode masks must drop old keys."""
    from transformers import AutoModelForCausalLM

    from tests.engine.tiny_models import build_tiny_model

    model = build_tiny_model("mistral", tmp_path, seed=3)
    model.config.sliding_window = 24
    model.save_pretrained(str(tmp_path), safe_serialization=True)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    prompts = make_prompts()
    expected = hf_greedy(model, prompts, MAX_NEW)
    llm = LLM(str(tmp_path), max_model_len=128, max_num_batched_tokens=32)
    assert llm.engine.runner.layer_windows == [24] * model.config.num_hidden_layers
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_sharded_checkpoint_loads(tmp_path, tiny_model_dir, hf_reference):
    _, model = tiny_model_dir("qwen3")
    model.save_pretrained(str(tmp_path), safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    folder, _ = tiny_model_dir("qwen3")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).write_bytes((folder / f).read_bytes())
    llm = LLM(str(tmp_path), max_model_len=128)
    outs = llm.generate([{"prompt_token_ids": p} for p in make_prompts()],
                        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == hf_reference("qwen3")


def test_missing_tensor_is_a_load_error(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file, save_file

    from kvgate.engine import ModelLoadError

    folder, _ = tiny_model_dir("llama")
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="missing weights: model.layers.1.self_attn.qkv_proj.weight"):
        LLM(str(tmp_path), max_model_len=128)
