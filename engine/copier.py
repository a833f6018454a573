"""The `copier` model: a tiny Llama trained here, on the CPU, to continue a text it has seen (induction), so that
speculative decoding by prompt lookup has a model whose outputs quote its prompt (a random-weight model never
does, and no drafts are accepted). `kvgate bench engine --model copier --speculative-config ...` uses it.

Training (seeded, no download, ~50 s on 2 CPU cores): sequences of random byte tokens repeating with a random
period, loss only where the sequence repeats. Short sequences first (the copying circuit forms after ~350 steps of
96 tokens), then 384-token ones so that it copies at the lengths the bench uses. The folder's name carries a hash
of the recipe: a second run, or another process, reuses it; a changed recipe builds a new one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from pathlib import Path

from kvgate.common.demo import _build_once, build_byte_tokenizer, cache_dir, write_tokenizer_files

log = logging.getLogger(__name__)

COPIER_RECIPE = {
    "version": 1,
    "seed": 20261127,
    "shape": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=1024),
    # (steps, sequence length, batch, longest period): short sequences until the copying circuit forms, then long.
    "stages": [(500, 96, 32, 48), (600, 384, 8, 192)],
    "lr": 1e-2,
    "warmup_steps": 50,
}


def recipe_key(recipe: dict = COPIER_RECIPE) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def ensure_copier_model(root: Path | None = None, recipe: dict = COPIER_RECIPE) -> Path:
    """Path of the copier model folder for this recipe, training it if absent."""
    target = (root or cache_dir() / "models") / f"copier-{recipe_key(recipe)}"
    return _build_once(target, "model.safetensors", lambda folder: build_copier_model(folder, recipe))


def repeating_batch(generator, length: int, batch: int, max_period: int, min_period: int = 8):
    """Random byte tokens repeating with a random period per row; mask: the positions that repeat (predictable)."""
    import torch

    periods = torch.randint(min_period, max_period + 1, (batch, 1), generator=generator)
    text = torch.randint(0, 256, (batch, length), generator=generator)
    pos = torch.arange(length)[None, :]
    return text.gather(1, pos % periods), pos >= periods


def copy_accuracy(model, generator, length: int, max_period: int, batch: int = 8) -> float:
    """Share of the predictable positions whose argmax is the repeated token."""
    import torch

    x, mask = repeating_batch(generator, length, batch, max_period)
    with torch.no_grad():
        pred = model(x).logits[:, :-1].argmax(-1)
    return float((pred == x[:, 1:])[mask[:, 1:]].float().mean())


def build_copier_model(folder: Path, recipe: dict = COPIER_RECIPE) -> None:
    import time

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    folder.mkdir(parents=True, exist_ok=True)
    tok = build_byte_tokenizer()
    shape = recipe["shape"]
    write_tokenizer_files(tok, folder, shape["max_position_embeddings"])
    config = LlamaConfig(vocab_size=tok.get_vocab_size(), bos_token_id=tok.token_to_id("<s>"),
                         eos_token_id=tok.token_to_id("</s>"), tie_word_embeddings=False, rms_norm_eps=1e-5,
                         architectures=["LlamaForCausalLM"], **shape)
    torch.manual_seed(recipe["seed"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    gen = torch.Generator().manual_seed(recipe["seed"] + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe["lr"], weight_decay=0.0, betas=(0.9, 0.98))
    step, t0 = 0, time.perf_counter()
    log.warning("training the copier model (once, ~1 min on a CPU; cached in %s)", folder.parent)
    last = len(recipe["stages"]) - 1
    for stage, (steps, length, batch, max_period) in enumerate(recipe["stages"]):
        for i in range(steps):
            # Warm-up, constant until the last stage, which decays it (cosine).
            lr = recipe["lr"] * min(1.0, (step + 1) / recipe["warmup_steps"])
            if stage == last:
                lr *= 0.5 * (1 + math.cos(math.pi * i / steps))
            for group in opt.param_groups:
                group["lr"] = lr
            x, mask = repeating_batch(gen, length, batch, max_period)
            logits = model(x).logits[:, :-1]
            target = x[:, 1:].masked_fill(~mask[:, 1:], -100)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
    model.eval()
    accuracy = copy_accuracy(model, torch.Generator().manual_seed(recipe["seed"] + 2), 384, 192)
    log.warning("copier model trained in %.0f s: copies %.1f%% of repeated tokens (384 tokens, periods <= 192)",
                time.perf_counter() - t0, 100 * accuracy)
    config.save_pretrained(str(folder))
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    (folder / "recipe.json").write_text(json.dumps({**recipe, "copy_accuracy": accuracy,
                                                    "train_seconds": time.perf_counter() - t0}, indent=2))
