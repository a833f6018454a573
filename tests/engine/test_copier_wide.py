"""copier-wide (engine/copier_wide.py): a small Llama embedded in a wider, deeper one computes the same function —
logits equal to HF's of the small model, and kvgate's greedy outputs equal on both — and shapes that cannot hold
it are refused. The bench's shape (0.37B parameters) is built from the trained copier only on demand."""

import json

import pytest
import torch
import transformers
from safetensors.torch import save_file

from kvgate.engine import LLM, SamplingParams
from kvgate.engine.copier import COPIER_RECIPE
from kvgate.engine.copier_wide import widen_copier
from kvgate.common.demo import build_byte_tokenizer, write_tokenizer_files

SMALL = dict(COPIER_RECIPE["shape"], max_position_embeddings=256)
WIDE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=5, num_attention_heads=8, num_key_value_heads=4)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    """A Llama of the copier's shape, random weights wide enough that greedy choices are not near-ties."""
    folder = tmp_path_factory.mktemp("small")
    tok = build_byte_tokenizer()
    config = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), tie_word_embeddings=False, rms_norm_eps=1e-5,
                                      architectures=["LlamaForCausalLM"], **SMALL)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.25)
            else:  # norms away from 1, so that a wrong norm scale shows
                p.uniform_(0.5, 1.5)
    config.save_pretrained(str(folder))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    write_tokenizer_files(tok, folder, SMALL["max_position_embeddings"])
    return folder, model


@pytest.mark.slow
def test_the_wide_model_computes_the_small_one(small_model, tmp_path):
    folder, small = small_model
    widen_copier(folder, tmp_path, WIDE)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["head_dim"]) == (256, 5, 32)
    wide = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert sum(p.numel() for p in wide.parameters()) > 10 * sum(p.numel() for p in small.parameters())
    x = torch.randint(0, 256, (2, 200), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = small.eval()(x).logits, wide(x).logits
    assert (a - b).abs().max() < 1e-4 * a.abs().max(), (a - b).abs().max()

    prompts = [x[0, :40].tolist(), x[1, :150].tolist(), x[0, 60:61].tolist()]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = [[o.outputs[0].token_ids for o in LLM(str(path), max_model_len=256).generate(
        [{"prompt_token_ids": p} for p in prompts], params)] for path in (folder, tmp_path)]
    assert outs[0] == outs[1]


@pytest.mark.parametrize("shape", [dict(WIDE, num_key_value_heads=2),  # two copier heads would share a KV head
                                   dict(WIDE, hidden_size=48, num_attention_heads=4),  # narrower than the copier
                                   dict(WIDE, num_hidden_layers=1)])
def test_shapes_that_cannot_hold_the_copier_are_refused(small_model, tmp_path, shape):
    with pytest.raises(ValueError):
        widen_copier(small_model[0], tmp_path, shape)
