"""The transformers fallback (engine/models/transformers_fallback.py): architectures outside the native families run
transformers' own modeling code on kvgate's paged KV cache, token-identical to HF's generate in every scheduling
mode of test_hf_parity.py; what the paged attention cannot compute is refused at load."""

import logging

import pytest
import torch

from kvgate.engine import LLM, ModelLoadError, SamplingParams
from tests.engine.test_draft_model import draft_dir  # noqa: F401 (a fixture: a one-layer draft of a tiny model)
from tests.engine.test_hf_parity import MAX_NEW, MODES, check_greedy_parity, make_prompts
from tests.engine.tiny_models import FALLBACK_FAMILIES, build_tiny_model, hf_greedy, hf_greedy_by_family, make_config


@pytest.fixture(scope="module")
def hf_reference(tiny_model_dir):
    return hf_greedy_by_family(tiny_model_dir, make_prompts(), MAX_NEW)


@pytest.mark.slow
@pytest.mark.parametrize("family", FALLBACK_FAMILIES)
@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_hf(family, mode, tiny_model_dir, hf_reference):
    from kvgate.engine.models.transformers_fallback import TransformersForCausalLM

    folder, _ = tiny_model_dir(family)
    llm = check_greedy_parity(family, mode, folder, hf_reference(family))
    assert isinstance(llm.engine.runner.model, TransformersForCausalLM)


@pytest.mark.slow
def test_gemma3_matches_hf(tiny_model_dir, hf_reference):
    """Gemma 3 (text, every layer full attention): a scaled embedding whose scale is a computed buffer, q/k norms,
    query_pre_attn_scalar as the attention scale, and final logit softcapping in the LM's head code."""
    folder, _ = tiny_model_dir("gemma3")
    check_greedy_parity("gemma3", "chunked-prefill", folder, hf_reference("gemma3"))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["chunked-prefill", "async-preemption"])
def test_moe_with_stacked_experts_matches_hf(mode, tiny_model_dir, hf_reference):
    """OLMoE: its checkpoint's per-expert tensors go into the expert slices of the stacked weights transformers'
    modules hold (transformers' own conversion of its checkpoints, followed by load_weights)."""
    folder, _ = tiny_model_dir("olmoe")
    check_greedy_parity("olmoe", mode, folder, hf_reference("olmoe"))


@pytest.mark.slow
def test_speculative_decoding_with_a_fallback_draft_matches_hf(tiny_model_dir, draft_dir):
    """Phi-3 speculating with a one-layer Phi-3 draft, both on the fallback: the verification chunks (a decode and
    its drafts, batched) and the draft's own KV cache give HF's greedy tokens."""
    from tests.engine import test_spec_decode
    from tests.engine.test_draft_model import spec_config

    folder, model = tiny_model_dir("phi3")
    expected = hf_greedy(model, test_spec_decode.repetitive_prompts(), test_spec_decode.MAX_NEW)
    llm = LLM(str(folder), max_model_len=128, speculative_config=spec_config(draft_dir("phi3")),
              **MODES["chunked-prefill"])
    test_spec_decode.check_speculative_greedy(llm, expected, "phi3", "chunked-prefill")


@pytest.mark.slow
def test_per_layer_windows_match_hf(tmp_path):
    """Gemma 3's layer_types (sliding layers with their own RoPE base beside a full-attention one): each HF attention
    module asks for its layer's window, which the metadata masks by."""
    config = make_config("gemma3")
    config.layer_types, config.sliding_window = ["sliding_attention", "sliding_attention", "full_attention"], 20
    model = build_tiny_model("gemma3", tmp_path, seed=3, config=config)
    prompts = [p for p in make_prompts() if len(p) > 20][:4]
    expected = hf_greedy(model, prompts, 12)
    llm = LLM(str(tmp_path), max_model_len=128, max_num_batched_tokens=32)
    assert llm.engine.runner.layer_windows == [20, 20, None] and llm.engine.runner.kv_window is None
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.slow
def test_uniform_sliding_window_matches_hf(tmp_path):
    """A window on every layer (Phi-3's sliding_window) goes to the attention metadata: prompts longer than it."""
    config = make_config("phi3")
    config.sliding_window = 24
    model = build_tiny_model("phi3", tmp_path, seed=3, config=config)
    expected = hf_greedy(model, make_prompts(), MAX_NEW)
    llm = LLM(str(tmp_path), max_model_len=128, max_num_batched_tokens=32)
    assert llm.engine.runner.layer_windows == [24] * config.num_hidden_layers
    outs = llm.generate([{"prompt_token_ids": p} for p in make_prompts()],
                        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.parametrize("family", [*FALLBACK_FAMILIES, "gemma3", "olmoe"])
def test_logits_match_hf_forward(family, tiny_model_dir):
    """A prefill then a decode on the paged cache give HF's own logits (Granite's logits_scaling and Gemma 3's
    softcapping included: greedy tokens alone would not see a monotone rescaling of the logits)."""
    from kvgate.engine.attention import AttentionMetadata
    from kvgate.engine.kv_quant import allocate_kv_caches
    from kvgate.engine.loader import load_hf_config, load_model

    folder, hf_model = tiny_model_dir(family)
    hf_config = load_hf_config(folder)
    model = load_model(hf_config, folder, torch.device("cpu"), torch.float32, 128)
    block_size, num_blocks = 16, 8
    kv_caches = allocate_kv_caches(model, hf_config.num_hidden_layers, num_blocks, block_size, torch.float32, None,
                                   torch.device("cpu"))
    tokens = make_prompts()[7]  # 70 tokens: 5 blocks
    blocks = [3, 0, 6, 1, 4]
    with torch.no_grad():
        expected = hf_model(torch.tensor([tokens])).logits[0]
        n = len(tokens) - 1

        def step(computed: int, new: int) -> torch.Tensor:
            meta = AttentionMetadata.build([(computed, new, blocks)], block_size, torch.device("cpu"),
                                           model.num_kv_heads, num_blocks)
            hidden = model(torch.tensor(tokens[computed:computed + new]), torch.arange(computed, computed + new),
                           kv_caches, meta)
            return model.compute_logits(hidden)

        prefill = step(0, n)
        decode = step(n, 1)
    torch.testing.assert_close(prefill, expected[:n], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(decode, expected[n:], rtol=1e-4, atol=1e-4)


def test_tied_embeddings_share_one_tensor(tiny_model_dir):
    from kvgate.engine.loader import load_hf_config, load_model

    folder, _ = tiny_model_dir("olmo2")
    model = load_model(load_hf_config(folder), folder, torch.device("cpu"), torch.float32, 128)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def _copy_with_weights(src, dst, edit) -> None:
    from safetensors.torch import load_file, save_file

    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(dst / "model.safetensors"))
    edit(weights)
    save_file(weights, str(dst / "model.safetensors"))


@pytest.mark.parametrize("edit, message", [
    (lambda w: w.pop("model.layers.1.self_attn.qkv_proj.weight"),
     "missing weights: model.layers.1.self_attn.qkv_proj.weight"),
    (lambda w: w.update({"model.layers.0.extra.weight": torch.zeros(2)}),
     "'model.layers.0.extra.weight' does not belong to Phi3ForCausalLM"),
    (lambda w: w.update({"model.norm.weight": torch.zeros(3)}),
     r"'model.norm.weight' has shape \(3,\), expected \(64,\)"),
], ids=["missing", "unknown", "wrong-shape"])
def test_bad_checkpoint_is_a_load_error(edit, message, tmp_path, tiny_model_dir):
    folder, _ = tiny_model_dir("phi3")
    _copy_with_weights(folder, tmp_path, edit)
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(tmp_path), max_model_len=128)


def test_missing_expert_tensor_is_named(tmp_path, tiny_model_dir):
    folder, _ = tiny_model_dir("olmoe")
    _copy_with_weights(folder, tmp_path, lambda w: w.pop("model.layers.1.mlp.experts.5.up_proj.weight"))
    missing = r"missing weights: model.layers.1.mlp.experts.gate_up_proj\[expert 5\]$"
    with pytest.raises(ModelLoadError, match=missing):
        LLM(str(tmp_path), max_model_len=128)
    _copy_with_weights(folder, tmp_path, lambda w: w.update(
        {"model.layers.1.mlp.experts.8.down_proj.weight": torch.zeros(64, 160)}))  # one expert past num_experts
    with pytest.raises(ModelLoadError, match="'model.layers.1.mlp.experts.8.down_proj.weight' does not belong"):
        LLM(str(tmp_path), max_model_len=128)


def _config(name: str, **kwargs):
    import transformers

    return getattr(transformers, name)(**kwargs)


@pytest.mark.parametrize("config, message", [
    (lambda: _config("Gemma2Config", architectures=["Gemma2ForCausalLM"]), "attn_logit_softcapping 50.0"),
    (lambda: _config("DeepseekV2Config", architectures=["DeepseekV2ForCausalLM"]), "multi-head latent attention"),
    (lambda: _config("T5Config", architectures=["T5ForConditionalGeneration"]), "encoder-decoder"),
    (lambda: _config("BertConfig", architectures=["BertForMaskedLM"]), "neither a native family nor a decoder-only"),
    (lambda: _config("LlavaConfig", architectures=["LlavaForConditionalGeneration"]), "multimodal"),
    (lambda: _config("LlamaConfig", architectures=[]), "none given in config.json"),
], ids=["softcapping", "latent-attention", "encoder-decoder", "encoder", "multimodal",
        "no-architecture"])
def test_unsupported_architectures_are_refused(config, message):
    from kvgate.engine.models import resolve_model_class

    with pytest.raises(ModelLoadError, match=message) as exc:
        resolve_model_class(config())
    assert "native families: LlamaForCausalLM" in str(exc.value)


def test_start_line_names_the_path_and_lora_is_refused(tiny_model_dir, caplog):
    from kvgate.common.errors import ConfigError

    with caplog.at_level(logging.INFO, logger="kvgate.engine"):
        LLM(str(tiny_model_dir("granite")[0]), max_model_len=128)
        LLM(str(tiny_model_dir("llama")[0]), max_model_len=128)
    ready = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine ready")]
    assert "(GraniteForCausalLM on the transformers fallback)" in ready[0], ready
    assert "(native LlamaForCausalLM)" in ready[1], ready
    with pytest.raises(ConfigError, match="LoRA is not supported for GraniteForCausalLM on the transformers fallback"):
        LLM(str(tiny_model_dir("granite")[0]), max_model_len=128, enable_lora=True)
