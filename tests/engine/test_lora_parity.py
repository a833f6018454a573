"""Multi-LoRA parity: greedy outputs per adapter are token-identical to HF transformers with that adapter applied by
PEFT, for tiny random models of two families and random adapters made locally with `peft` (different ranks,
alphas, targets, one rsLoRA) — in one engine batch mixing three adapters and the base model, with prefix caching
on (the adapters' prompts share a prefix), chunked prefill, preemption, and fewer slots than adapters."""

from __future__ import annotations

import random

import pytest
import torch

from kvgate.engine import LLM, SamplingParams
from kvgate.engine.lora.request import LoRARequest
from tests.engine.tiny_models import hf_greedy

pytestmark = pytest.mark.slow

MAX_NEW = 12
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # name -> LoraConfig arguments
    "all-r8": dict(r=8, lora_alpha=16, target_modules=ALL),
    "attn-r4-rslora": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"], use_rslora=True),
    "mlp-r16": dict(r=16, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj", "k_proj"]),
}
MODES = {
    "prefix-caching": dict(),
    "chunked-prefill": dict(max_num_batched_tokens=16),
    "preemption": dict(num_gpu_blocks_override=14, max_num_seqs=16),
    "two-slots": dict(max_loras=2, max_cpu_loras=2),  # three adapters, two slots: some wait their turn
}


def make_adapter(base_dir, out_dir, seed: int, **config) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **config))
    with torch.no_grad():  # large enough to move greedy choices away from the base model's
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.3)
    peft_model.save_pretrained(str(out_dir))


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(256) for _ in range(32)]  # every adapter sees this 2-block prefix: no block sharing
    return [shared + [rng.randrange(256) for _ in range(n)] for n in (5, 17, 9)] + \
        [[rng.randrange(256) for _ in range(n)] for n in (3, 21)]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request, tiny_model_dir, tmp_path_factory):
    """(model folder, {adapter name: folder}, {adapter name or None: expected outputs per prompt})."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder, base_model = tiny_model_dir(request.param)
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    paths = {}
    for seed, (name, config) in enumerate(ADAPTERS.items()):
        paths[name] = root / name
        make_adapter(folder, paths[name], seed, **config)

    def greedy(model):
        return hf_greedy(model, prompts(), MAX_NEW)

    expected = {None: greedy(base_model)}
    for name, path in paths.items():
        hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        expected[name] = greedy(PeftModel.from_pretrained(hf, str(path)).eval())
    return folder, paths, expected


@pytest.mark.parametrize("mode", list(MODES))
def test_mixed_batch_matches_peft(setup, mode):
    folder, paths, expected = setup
    engine_args = dict(max_model_len=128, enable_lora=True, max_loras=4, max_lora_rank=16)
    engine_args.update(MODES[mode])
    llm = LLM(str(folder), **engine_args)
    loras = {name: LoRARequest(name, i, str(path)) for i, (name, path) in enumerate(paths.items(), start=1)}
    for lora in loras.values():
        llm.add_lora(lora)
    jobs = [(name, i, p) for i, p in enumerate(prompts()) for name in [None, *loras]]
    random.Random(3).shuffle(jobs)  # adapters interleaved in the batch
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for _, _, p in jobs], params,
                        lora_request=[loras[name] if name else None for name, _, _ in jobs])
    for (name, i, _), out in zip(jobs, outs):
        assert out.outputs[0].token_ids == expected[name][i], f"{mode}: adapter {name} prompt {i} diverges from PEFT"
    stats = llm.engine.stats()
    if mode == "preemption":
        assert stats.num_preemptions > 0
    assert stats.max_lora == engine_args["max_loras"]


def test_adapters_change_the_outputs(setup):
    _, _, expected = setup
    for name in ADAPTERS:
        assert expected[name] != expected[None], f"{name} generates what the base model does: a test that cannot fail"
