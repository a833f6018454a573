"""The `copier-wide` model: the trained `copier` (engine/copier.py) embedded, function unchanged, in a Llama of a
real small model's cost (hidden 1024, 24 layers, GQA 16/4 heads, 0.37B parameters), so that speculative decoding
can be measured where a step costs what a real model's step costs (reading ~0.7 GB of bf16 weights on a GPU)
while prompt lookup's drafts are accepted as they are on the copier (a random-weight model of that size accepts
almost none). No training beyond the copier's: the wide model is built from it in a few seconds.

How the copier's function survives the widening (float32: logits equal to the copier's up to rounding; tested):
- the residual stream keeps the copier's 64 dimensions first and zeros after them: embeddings, attention outputs
  and MLP outputs write only there;
- RMSNorm over 1024 dimensions of which 960 are zero divides by rms/4: the norm weights are the copier's / 4 and
  the epsilon the copier's / 16, so every norm's output is the copier's;
- each copier head (head_dim 16) lives in a query head of the wide model's group for its own KV head (head_dim 64):
  its dimension i goes to 4i and 8 + i to 32 + 4i, where RoPE turns it at the copier's frequency and pairs it
  with the same partner; its queries are scaled by 2 (= sqrt(64 / 16)) for the wider softmax scale;
- the copier's MLP takes the first 128 of 4096 intermediate channels;
- the 22 other layers read the stream with random weights (as much work as real layers) and write nothing back
  (their attention output and MLP down projections are zero), so they leave the stream as it was.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from kvgate.common import bounded_json
from kvgate.engine.copier import COPIER_RECIPE, ensure_copier_model, recipe_key
from kvgate.common.demo import _build_once, cache_dir

WIDE_SHAPE = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                  num_key_value_heads=4)


def wide_key(shape: dict) -> str:
    return hashlib.sha256(json.dumps({"copier": recipe_key(COPIER_RECIPE), "shape": shape, "version": 1},
                                     sort_keys=True).encode()).hexdigest()[:12]


def ensure_wide_copier(root: Path | None = None, shape: dict = WIDE_SHAPE) -> Path:
    """Path of the copier-wide model folder, building it (and the copier) if absent."""
    target = (root or cache_dir() / "models") / f"copier-wide-{wide_key(shape)}"
    return _build_once(target, "model.safetensors", lambda folder: widen_copier(ensure_copier_model(root), folder,
                                                                                 shape))


def widen_copier(source: Path, folder: Path, shape: dict = WIDE_SHAPE, seed: int = 0) -> None:
    """Write into folder a Llama of `shape` computing the copier at `source` (see the module doc)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    small = bounded_json.read(Path(source) / "config.json", bounded_json.CONFIG_BYTES)
    sw = load_file(str(Path(source) / "model.safetensors"))
    h_s, heads_s = small["hidden_size"], small["num_attention_heads"]
    d_s = small.get("head_dim") or h_s // heads_s
    hidden, heads, kv_heads = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    d, inter, layers = hidden // heads, shape["intermediate_size"], shape["num_hidden_layers"]
    if small["num_key_value_heads"] != heads_s or heads_s != kv_heads or heads % kv_heads:
        raise ValueError("the copier's heads must each get a KV head of their own in the wide model")
    if d % d_s or hidden < h_s or inter < small["intermediate_size"] or layers < small["num_hidden_layers"]:
        raise ValueError(f"cannot embed the copier ({h_s}/{d_s}) in {shape}")
    r = d // d_s
    # Within a head: the copier's dimension i -> r*i, d_s/2 + i -> d/2 + r*i (RoPE's frequency and partner kept).
    dim_map = torch.tensor([r * i for i in range(d_s // 2)] + [d // 2 + r * i for i in range(d_s // 2)])
    group = heads // kv_heads
    q_rows = torch.cat([(h * group) * d + dim_map for h in range(heads_s)])  # copier head h -> query head h*group
    kv_rows = torch.cat([h * d + dim_map for h in range(heads_s)])
    norm_scale = math.sqrt(h_s / hidden)  # rms over `hidden` dims of which only h_s are non-zero
    gen = torch.Generator().manual_seed(seed)

    def rand(*size):
        return torch.randn(*size, generator=gen) * 0.02

    def norm(name):
        w = torch.ones(hidden)
        w[:h_s] = sw[name] * norm_scale
        return w

    state = {}
    embed = torch.zeros(small["vocab_size"], hidden)
    embed[:, :h_s] = sw["model.embed_tokens.weight"]
    state["model.embed_tokens.weight"] = embed
    lm_head = torch.zeros(small["vocab_size"], hidden)
    lm_head[:, :h_s] = sw["lm_head.weight"]
    state["lm_head.weight"] = lm_head
    state["model.norm.weight"] = norm("model.norm.weight")
    for layer in range(layers):
        p = f"model.layers.{layer}."
        q, k, v = rand(heads * d, hidden), rand(kv_heads * d, hidden), rand(kv_heads * d, hidden)
        gate, up = rand(inter, hidden), rand(inter, hidden)
        o, down = torch.zeros(hidden, heads * d), torch.zeros(hidden, inter)
        ln_in, ln_post = torch.ones(hidden), torch.ones(hidden)
        if layer < small["num_hidden_layers"]:
            s = lambda name: sw[p + name]  # noqa: E731
            q, k, v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
            q[q_rows, :h_s] = s("self_attn.q_proj.weight") * math.sqrt(d / d_s)
            k[kv_rows, :h_s] = s("self_attn.k_proj.weight")
            v[kv_rows, :h_s] = s("self_attn.v_proj.weight")
            o[:h_s, q_rows] = s("self_attn.o_proj.weight")  # a query head's output sits at its own rows
            i_s = small["intermediate_size"]
            gate, up = torch.zeros_like(gate), torch.zeros_like(up)
            gate[:i_s, :h_s], up[:i_s, :h_s] = s("mlp.gate_proj.weight"), s("mlp.up_proj.weight")
            down[:h_s, :i_s] = s("mlp.down_proj.weight")
            ln_in, ln_post = norm(p + "input_layernorm.weight"), norm(p + "post_attention_layernorm.weight")
        state.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                      p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": o,
                      p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                      p + "mlp.down_proj.weight": down, p + "input_layernorm.weight": ln_in,
                      p + "post_attention_layernorm.weight": ln_post})
    folder.mkdir(parents=True, exist_ok=True)
    config = {**small, **shape, "head_dim": d, "rms_norm_eps": small["rms_norm_eps"] * norm_scale ** 2}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(source) / name, folder / name)
