"""--kv-cache-dtype int8|fp8|fp8_e4m3|fp8_e5m2 on the torch path (CPU): greedy agreement with the unquantized
cache, capacity in blocks and its effect on preemption, the sim backend's capacity, the flag and the metric. The
Triton kernels over a quantized cache are checked in test_triton_attention.py (interpreter) and test_cuda.py."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

from kvgate.engine import LLM, SamplingParams
from kvgate.engine import kv_quant
from kvgate.engine.config import EngineConfig
from kvgate.common.errors import ConfigError
from tests.engine.tiny_models import SMOOTH_STDS, build_tiny_model, make_config, random_tokens

NUM_PROMPTS, MAX_NEW = 10, 64


@pytest.fixture(scope="module")
def smooth_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("smooth-llama")
    build_tiny_model("llama", folder, stds=SMOOTH_STDS)
    return folder


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory):
    """A tiny Qwen3 with head_dim 128, the common size, so a token's scale costs what it costs in real models."""
    folder = tmp_path_factory.mktemp("qwen3-hd128")
    config = make_config("qwen3")
    config.head_dim = 128
    build_tiny_model("qwen3", folder, config=config)
    return folder


def _greedy(folder, prompts, **engine_args):
    llm = LLM(str(folder), max_model_len=128, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def _agreement(base, other):
    """(tokens equal position by position up to each output's first divergence, largest |logprob difference| of
    the chosen tokens over those positions: the same context in both runs)."""
    same, worst = 0, 0.0
    for (tokens, lps), (q_tokens, q_lps) in zip(base, other):
        n = next((i for i, (a, b) in enumerate(zip(tokens, q_tokens)) if a != b), len(tokens))
        same += n
        worst = max([worst] + [abs(a - b) for a, b in zip(lps[:n], q_lps[:n])])
    return same, worst


# kv_cache_dtype -> (least fraction of tokens before the first divergence, largest logprob difference before it).
# Measured on this model (llama, SMOOTH_STDS, 10 prompts x 64 tokens): int8 640/640 and 0.0030; fp8 (e4m3) 640/640
# and 0.0176; fp8_e5m2 523/640 and 0.0712 (two mantissa bits: vLLM's less precise fp8).
EXPECTED = {"int8": (0.95, 0.01), "fp8": (0.95, 0.05), "fp8_e5m2": (0.75, 0.15)}


@pytest.mark.slow
def test_greedy_agrees_with_the_unquantized_cache(smooth_llama, monkeypatch):
    prompts = [random_tokens(8 + 5 * i, seed=100 + i) for i in range(NUM_PROMPTS)]
    base = _greedy(smooth_llama, prompts)
    total = NUM_PROMPTS * MAX_NEW
    for dtype, (least, bound) in EXPECTED.items():
        same, worst = _agreement(base, _greedy(smooth_llama, prompts, kv_cache_dtype=dtype))
        print(f"{dtype}: {same}/{total} tokens before the first divergence, max |dlogprob| {worst:.4f}")
        assert same >= least * total, (dtype, same)
        assert worst <= bound, (dtype, worst)
    # The control: the same run reading zeros instead of the cached K/V agrees far less, so the figures above
    # measure what the cache holds (on this model attention decides the output).
    real_gather = kv_quant.QuantizedKVCache.gather
    monkeypatch.setattr(kv_quant.QuantizedKVCache, "gather",
                        lambda self, *args: torch.zeros_like(real_gather(self, *args)))
    same, _ = _agreement(base, _greedy(smooth_llama, prompts, kv_cache_dtype="int8"))
    print(f"control (cache reads zeroed): {same}/{total}")
    assert same < 0.5 * total, same


def test_quantize_round_trip():
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 3, 50)[:, None, None]
    x[0] = 0.0  # an all-zero head vector: scale floored, values 0
    for name, rel in (("int8", 0.01), ("fp8_e4m3", 0.04), ("fp8_e5m2", 0.08)):
        spec = kv_quant.kv_quant_spec(name)
        values, scales = kv_quant.quantize(x, spec)
        assert values.dtype == spec.storage_dtype and scales.shape == x.shape[:2]
        back = kv_quant.dequantize(values, scales, spec, torch.float32)
        assert torch.equal(back[0], x[0])
        err = (back - x).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-30)
        assert err[1:].max() < rel, (name, err.max())
        # each head vector's largest value maps to qmax: the full range is used
        assert torch.allclose(back.abs().amax(-1)[1:], x.abs().amax(-1)[1:], rtol=1e-6)
    assert kv_quant.kv_quant_spec("fp8") is kv_quant.kv_quant_spec("fp8_e4m3")
    assert kv_quant.kv_quant_spec("auto") is None


def _blocks(folder, **engine_args):
    llm = LLM(str(folder), max_model_len=128, **engine_args)
    return llm, llm.engine.stats().num_blocks


@pytest.mark.slow
def test_capacity_doubles_and_preemption_goes(wide_heads):
    """Same --kv-cache-memory: int8/fp8 hold (2 * 128) / (128 + 4) = 1.94x the blocks of bf16 (a float32 scale per
    128 values) and 3.88x those of float32; a workload that preempts in bf16 runs without preemption."""
    memory = 20 * 2 * 2 * 16 * 2 * 128 * 2  # 20 bf16 blocks: 2 layers x 2 KV heads x 16 tokens x (K, V) x 128 x 2 B
    prompts = [random_tokens(20, seed=i) for i in range(8)]  # 8 x (20 + 40 tokens) = 32 blocks at once
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    blocks, preemptions = {}, {}
    for dtype, kv in (("bfloat16", "auto"), ("bfloat16", "int8"), ("bfloat16", "fp8"), ("bfloat16", "fp8_e5m2"),
                      ("float32", "auto"), ("float32", "int8")):
        llm, blocks[dtype, kv] = _blocks(wide_heads, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory=memory,
                                         max_num_seqs=8)
        assert llm.engine.kv_cache_manager.num_blocks == blocks[dtype, kv]
        if dtype == "bfloat16":
            llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            preemptions[kv] = llm.engine.stats().num_preemptions
    print("blocks:", blocks, "preemptions:", preemptions)
    assert blocks["bfloat16", "auto"] == 20
    for kv in ("int8", "fp8", "fp8_e5m2"):
        assert blocks["bfloat16", kv] == memory // (2 * 2 * 16 * 2 * (128 + 4)) == 38  # 1.9x after rounding down
        assert preemptions[kv] == 0
    assert preemptions["auto"] > 0
    assert blocks["float32", "auto"] == 10 and blocks["float32", "int8"] == 38


def test_sim_backend_scales_capacity_the_same_way():
    from kvgate.engine.llm_engine import LLMEngine
    from kvgate.engine.sim_runner import SimProfile

    profile = SimProfile(kv_cache_memory=2**30, max_model_len=4096)
    blocks = {kv: LLMEngine(EngineConfig(model="sim", backend="sim", sim_profile=profile, kv_cache_dtype=kv))
              .stats().num_blocks for kv in ("auto", "int8", "fp8")}
    # 131072 bytes a token in bf16 (head_dim 128) -> 131072 * 132 / 256 = 67584: 2**30 / (67584 * 16) = 992 blocks
    assert blocks["auto"] == 2**30 // (131072 * 16) == 512
    assert blocks["int8"] == blocks["fp8"] == 2**30 // (67584 * 16) == 992
    assert blocks["int8"] / blocks["auto"] == pytest.approx(2 * 128 / 132, rel=0.01)  # the torch runner's ratio


def test_flag_values_and_errors(capsys):
    from kvgate.engine.cli_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args("m", parser.parse_args([])).kv_cache_dtype == "auto"
    for value in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"):
        assert engine_config_from_args("m", parser.parse_args(["--kv-cache-dtype", value])).kv_cache_dtype == value
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int4"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--kv-cache-dtype: invalid choice: 'int4'" in err and "fp8_e5m2" in err
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2, int8"):
        EngineConfig(model="m", kv_cache_dtype="fp16")


def test_cache_config_info_carries_cache_dtype():
    from kvgate.engine.engine_messages import EngineInfo
    from kvgate.engine.server.metrics import EngineStatsCollector

    info = EngineInfo(model_name="m", max_model_len=128, vocab_size=262, block_size=16, num_blocks=38,
                      eos_token_ids=(), tokenizer_path="")
    llm = SimpleNamespace(stats=None, info=info, config=EngineConfig(model="m", kv_cache_dtype="fp8"),
                          num_prefill_tokens_pending=0, num_prefill_tokens_awaiting_step=0, step_age_s=0.0,
                          num_unfinished=0)
    families = {f.name: f for f in EngineStatsCollector(llm, "m").collect()}
    (sample,) = families["vllm:cache_config_info"].samples
    assert sample.labels == {"block_size": "16", "cache_dtype": "fp8", "num_gpu_blocks": "38", "model_name": "m"}
