"""The `demo` model: a small Llama with a byte-level tokenizer, built deterministically on first use.

It needs no download: the weights are drawn from a fixed seed and written as an ordinary HF folder
(config.json, model.safetensors, tokenizer.json with a chat template) in the user cache, so everything
that loads a real model folder loads this one the same way. Its text is random bytes-as-characters.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

DEMO_VERSION = "v1"
DEMO_SEED = 20261121
SPECIAL_TOKENS = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
DEMO_SHAPE = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, max_position_embeddings=4096)


def cache_dir() -> Path:
    root = os.environ.get("KVGATE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvgate")
    return Path(root)


def ensure_demo_model(root: Path | None = None) -> Path:
    """Path of the demo model folder, building it if absent."""
    target = (root or cache_dir() / "models") / f"demo-{DEMO_VERSION}"
    return _build_once(target, "model.safetensors", build_demo_model)


def ensure_byte_tokenizer(root: Path | None = None) -> Path:
    """A folder with just the demo's byte-level tokenizer (for the sim backend, which needs no weights)."""
    target = (root or cache_dir() / "tokenizers") / f"byte-{DEMO_VERSION}"
    return _build_once(target, "tokenizer_config.json", lambda folder: write_tokenizer_files(
        build_byte_tokenizer(), folder, DEMO_SHAPE["max_position_embeddings"]))


def _build_once(target: Path, marker: str, build) -> Path:
    """Build into a temporary sibling and rename it into place: safe when several processes race."""
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / marker).is_file():  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_byte_tokenizer():
    """A byte-level tokenizer: token id b is byte b (0..255), then the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: b for b, char in _byte_level_chars().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def _byte_level_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which the ByteLevel pre-tokenizer and decoder use."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def write_tokenizer_files(tok, folder: Path, max_length: int) -> None:
    """tokenizer.json plus a tokenizer_config.json with the special tokens and the chat template."""
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "</s>",
        "add_bos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }, indent=2))


def build_demo_model(folder: Path) -> None:
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    folder.mkdir(parents=True, exist_ok=True)
    tok = build_byte_tokenizer()
    write_tokenizer_files(tok, folder, DEMO_SHAPE["max_position_embeddings"])
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    config = LlamaConfig(vocab_size=tok.get_vocab_size(), bos_token_id=bos, eos_token_id=eos,
                         tie_word_embeddings=False, rms_norm_eps=1e-5, architectures=["LlamaForCausalLM"],
                         **DEMO_SHAPE)
    config.save_pretrained(str(folder))
    save_file(_demo_weights(config), str(folder / "model.safetensors"), metadata={"format": "pt"})


def _demo_weights(config) -> dict:
    """Seeded normal weights in a fixed order (independent of any library's init code); norms at 1."""
    import torch

    g = torch.Generator().manual_seed(DEMO_SEED)
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    d = h // config.num_attention_heads
    kv = config.num_key_value_heads * d
    std = 0.02 * 4  # wider than HF's default so the random model's next-token choices are not near-ties

    def normal(*shape):
        return (torch.randn(*shape, generator=g) * std).contiguous()

    weights = {"model.embed_tokens.weight": normal(v, h)}
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        weights |= {
            p + "self_attn.q_proj.weight": normal(h, h),
            p + "self_attn.k_proj.weight": normal(kv, h),
            p + "self_attn.v_proj.weight": normal(kv, h),
            p + "self_attn.o_proj.weight": normal(h, h),
            p + "mlp.gate_proj.weight": normal(i, h),
            p + "mlp.up_proj.weight": normal(i, h),
            p + "mlp.down_proj.weight": normal(h, i),
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
        }
    weights["model.norm.weight"] = torch.ones(h)
    weights["lm_head.weight"] = normal(v, h)
    # Steer the random model towards printable ASCII so its output reads as text: the LM head rows of
    # other tokens are zero (logit 0) while printable rows are scaled up, so their top logits win.
    printable = torch.tensor([32 <= t < 127 or t == 10 for t in range(v)])
    weights["lm_head.weight"] = torch.where(printable[:, None], weights["lm_head.weight"] * 3, 0.0)
    return weights
