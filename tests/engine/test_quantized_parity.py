"""Quantized checkpoints end to end: each format's tiny models (tests/engine/quant_checkpoints.py) generate
token-identical greedy outputs to HF transformers' generate() over the weights the format's own library
dequantizes (fp8: transformers' own loader of the quantized folder), in every scheduling mode of
test_hf_parity.py (the MoE family in two of them), and the engine holds exactly those weights."""

from __future__ import annotations

import shutil

import pytest
import torch

from kvgate.engine import LLM, SamplingParams
from tests.engine.quant_checkpoints import QUANT_FORMATS, is_projection, read_checkpoint, write_quantized
from tests.engine.test_hf_parity import MODES, make_prompts
from tests.engine.tiny_models import hf_greedy

pytestmark = pytest.mark.slow

MAX_NEW = 12
# A dense family in every mode; a MoE family (its experts quantized, its first layer dense) in two, the one that
# checks the weights and the one with the most moving parts: its HF reference and steps are the slow ones.
CASES = [("llama", mode) for mode in MODES] + [("qwen3_moe", mode) for mode in ("no-prefix-caching",
                                                                               "async-preemption")]


@pytest.fixture(scope="module")
def quantized(tiny_model_dir, tmp_path_factory):
    """(family, format) -> (quantized folder, reference weights by checkpoint name, HF greedy outputs)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    cache: dict = {}

    def get(family: str, fmt: str):
        if (family, fmt) in cache:
            return cache[family, fmt]
        dense, _ = tiny_model_dir(family)
        out = tmp_path_factory.mktemp(f"{family}-{fmt}")
        reference = write_quantized(dense, out, fmt)
        if fmt == "fp8":  # transformers' own loader reads the quantized folder (dequantizing it on CPU)
            hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
            state = hf.state_dict()
            reference = {n: state[n] for n in read_checkpoint(dense) if is_projection(n) and n in state}
        else:  # the library's dequantized weights in the dense model's folder
            ref_folder = tmp_path_factory.mktemp(f"{family}-{fmt}-reference")
            shutil.copytree(dense, ref_folder, dirs_exist_ok=True)
            save_file({**read_checkpoint(dense), **reference}, str(ref_folder / "model.safetensors"),
                      metadata={"format": "pt"})
            hf = AutoModelForCausalLM.from_pretrained(str(ref_folder), dtype=torch.float32)
        cache[family, fmt] = out, reference, hf_greedy(hf.eval(), make_prompts(), MAX_NEW)
        return cache[family, fmt]

    return get


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
@pytest.mark.parametrize("family,mode", CASES)
def test_quantized_greedy_matches_hf(family, mode, fmt, quantized):
    folder, reference, expected = quantized(family, fmt)
    llm = LLM(str(folder), max_model_len=128, dtype="float32", **MODES[mode])
    try:
        assert llm.engine.quantization.method == ("compressed-tensors" if fmt.startswith("ct-") else fmt)
        if mode == "no-prefix-caching":  # once per checkpoint: every quantized weight is the reference's, exactly
            model = llm.engine.runner.model
            params = dict(model.named_parameters())
            assert reference
            for name, weight in reference.items():
                _, dest, _ = model._destination(name, weight, params, {})
                assert torch.equal(dest, weight.float()), f"{family}/{fmt}: {name} differs from the reference"
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in make_prompts()], params)
        for i, (out, want) in enumerate(zip(outs, expected)):
            assert out.outputs[0].token_ids == want, f"{family}/{fmt}/{mode}: prompt {i} diverges from HF"
        if mode.endswith("preemption"):
            assert llm.engine.stats().num_preemptions > 0
    finally:
        llm.engine.close()

@pytest.mark.parametrize("fmt", ["ct-fp8-channel", "ct-w4a16"])
def test_transformers_compressed_tensors_loader_agrees(fmt, quantized):
    """transformers' own compressed-tensors loader (dequantize=True) reads the symmetric compressed-tensors
    checkpoints to the same weights, and generates what the engine generates. (It cannot read asymmetric
    pack-quantized zero points: it expects them unpacked.)"""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    folder, reference, expected = quantized("llama", fmt)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                              quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    state = hf.state_dict()
    for name, weight in reference.items():
        assert torch.equal(state[name], weight.float()), name
    assert hf_greedy(hf, make_prompts(), MAX_NEW) == expected
