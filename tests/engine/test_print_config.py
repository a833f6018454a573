"""`kvgate serve --print-config` reads no weights: the settings come from config.json, the safetensors headers and
the device, and are the ones a real start derives. Compared line by line with engine starts (in this process, from
the same flags) of tiny random models: unsharded and sharded, a bf16 checkpoint the CPU casts to float32, given
sizes, quantized KV caches, a KV cache small enough to lower max_model_len and max_num_seqs, a draft model, LoRA,
the demo. The printed weight sizes are the started engines' parameter bytes. No byte of tensor data is read: with
the loader's reads made to fail, a checkpoint of garbage after valid headers, and a 1.9 GB sparse checkpoint."""

import copy
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvgate.cli import build_parser, main
from kvgate.engine import loader
from kvgate.engine.cli_args import engine_config_from_args
from kvgate.engine.llm import LLM, resolve_model_path
from tests.engine.test_auto_config import served_settings

WEIGHT_ROWS = ("weights", "draft_weights")
# The comparisons in this process run on the CPU: on CUDA the memory profile of a second model in the same process
# sees what the first left behind (cuBLAS workspaces); test_print_config_on_cuda compares two processes instead.
ON_CPU = ["--device", "cpu"] if torch.cuda.is_available() else []
KVGATE = str(Path(sys.executable).parent / "kvgate")


def print_config(capsys, model, flags=()) -> list[tuple[str, str]]:
    """`kvgate serve MODEL --print-config FLAGS...` in this process: its rows as (name, value and source)."""
    capsys.readouterr()
    code = main(["serve", str(model), "--print-config", *flags])
    out = capsys.readouterr()
    assert code == 0, out.err
    return [tuple(line.split(None, 1)) for line in out.out.splitlines()]


def start(model, flags=()):
    """A real engine start from the same flags, its config made as `kvgate serve` makes it."""
    args = build_parser().parse_args(["serve", str(model), *flags])
    return LLM.from_config(engine_config_from_args(resolve_model_path(str(model)), args)).engine


def printed_bytes(rows, name: str) -> int:
    return int(re.search(r"\((\d+) bytes: ", dict(rows)[name]).group(1))


def parameter_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir, tmp_path_factory):
    """name -> folder: the tiny families, llama's weights in bf16 and in shards, a one-layer draft of llama."""
    from kvgate.common.demo import build_byte_tokenizer, write_tokenizer_files

    root = tmp_path_factory.mktemp("print-config")
    folders = {family: tiny_model_dir(family)[0] for family in ("llama", "mistral", "qwen2", "qwen3")}
    llama_folder, llama = tiny_model_dir("llama")
    sharded = root / "llama-sharded-bf16"
    copy.deepcopy(llama).to(torch.bfloat16).save_pretrained(str(sharded), safe_serialization=True,
                                                            max_shard_size="60KB")
    assert len(list(sharded.glob("*.safetensors"))) >= 2 and (sharded / "model.safetensors.index.json").is_file()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama_folder / f, sharded / f)
    folders["llama-sharded-bf16"] = sharded
    draft = copy.deepcopy(llama)
    draft.model.layers = draft.model.layers[:1]
    draft.config.num_hidden_layers = 1
    if getattr(draft.config, "layer_types", None):
        draft.config.layer_types = draft.config.layer_types[:1]
    draft.save_pretrained(str(root / "draft"), safe_serialization=True)
    write_tokenizer_files(build_byte_tokenizer(), root / "draft", llama.config.max_position_embeddings)
    folders["draft"] = root / "draft"
    return folders


CASES = {
    "qwen2, tied embeddings, everything derived": ("qwen2", []),
    "sharded bf16 checkpoint in float32, a KV cache of 8 blocks": ("llama-sharded-bf16",
                                                                   ["--kv-cache-memory", "64KiB"]),
    "given sizes, bf16, int8 KV": ("qwen3", ["--dtype", "bfloat16", "--kv-cache-dtype", "int8", "--max-num-seqs", "4",
                                             "--max-model-len", "256", "--max-num-batched-tokens", "64",
                                             "--cpu-threads", "2"]),
    "fp8 KV, 32-token blocks": ("mistral", ["--kv-cache-dtype", "fp8", "--block-size", "32",
                                            "--kv-cache-memory", "1MiB"]),
    "a draft model": ("llama", ["--speculative-config", "DRAFT"]),
    "ngram speculation and LoRA": ("qwen2", ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                                             "--speculative-config",
                                             '{"method": "ngram", "num_speculative_tokens": 2}']),
    "the demo": ("demo", ["--kv-cache-memory", "4MiB"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_print_config_prints_what_a_start_derives(capsys, checkpoints, case):
    name, flags = CASES[case]
    model = checkpoints.get(name, name)
    draft = json.dumps({"method": "draft_model", "model": str(checkpoints["draft"]), "num_speculative_tokens": 2})
    flags = [draft if f == "DRAFT" else f for f in flags] + ON_CPU
    printed = print_config(capsys, model, flags)
    engine = start(model, flags)
    try:
        started = [tuple(line.split(None, 1)) for line in engine.settings.lines()]
        assert [row for row in printed if row[0] not in WEIGHT_ROWS] == started
        assert [row[0] for row in printed][:4] == ["device", "cpu_threads", "dtype", "weights"]
        assert printed_bytes(printed, "weights") == parameter_bytes(engine.runner.model)
        if engine.runner.draft is not None:
            assert printed_bytes(printed, "draft_weights") == parameter_bytes(engine.runner.draft.model)
            assert "draft_weights" in dict(printed)
        else:
            assert "draft_weights" not in dict(printed)
    finally:
        engine.close()
    if name == "llama-sharded-bf16":  # stored as bf16, counted as the float32 the CPU runs it in
        stored = json.loads((model / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
        assert dict(printed)["dtype"].startswith("float32") and printed_bytes(printed, "weights") == 2 * stored
        assert dict(printed)["max_model_len"] == "128  (the model's 512, lowered to what the KV cache holds)"
        assert dict(printed)["max_num_seqs"].startswith("8  (default 128, lowered")


def test_print_config_reads_no_tensor_data(capsys, monkeypatch, checkpoints, tmp_path):
    """The loader's reads fail, and a checkpoint whose tensor bytes are garbage (0xff: NaNs) after valid headers
    prints what the intact one prints."""
    for name in ("qwen2", "llama-sharded-bf16"):
        good = checkpoints[name]
        expected = print_config(capsys, good, ON_CPU)
        bad = shutil.copytree(good, tmp_path / name)
        for f in bad.glob("*.safetensors"):
            data = f.read_bytes()
            start_of_data = 8 + struct.unpack("<Q", data[:8])[0]
            f.write_bytes(data[:start_of_data] + b"\xff" * (len(data) - start_of_data))
        with monkeypatch.context() as m:
            def refuse(*args, **kwargs):
                raise AssertionError("--print-config read tensor data")

            m.setattr(loader, "load_safetensors", refuse)
            m.setattr(loader.SafetensorsFile, "tensor", refuse)
            m.setattr(loader.SafetensorsFile, "release", refuse)
            got = print_config(capsys, bad, ON_CPU)
        assert [(n, rest.replace(str(bad), str(good))) for n, rest in got] == expected


def test_print_config_checks_the_headers_against_the_model(capsys, checkpoints, tmp_path):
    """A tensor missing from the checkpoint is the error a start gives, from the headers alone."""
    from safetensors.torch import load_file, save_file

    bad = shutil.copytree(checkpoints["qwen3"], tmp_path / "m")
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["model.norm.weight"]
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    capsys.readouterr()
    assert main(["serve", str(bad), "--print-config", *ON_CPU]) == 1
    assert "checkpoint is missing weights: model.norm.weight" in capsys.readouterr().err


def _write_sparse_checkpoint(folder: Path, shapes: dict[str, tuple[int, ...]], shards: int = 2) -> int:
    """bf16 safetensors shards and their index for `shapes`, the tensor bytes a hole in each file (nothing written,
    nothing on disk); returns the stored bytes."""
    names = list(shapes)
    weight_map, total = {}, 0
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        header, offset = {}, 0
        for name in names[i::shards]:
            size = 2 * torch.Size(shapes[name]).numel()
            header[name] = {"dtype": "BF16", "shape": list(shapes[name]), "data_offsets": [offset, offset + size]}
            offset += size
            weight_map[name] = file
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(folder / file, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + offset)
        total += offset
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                     "weight_map": weight_map}))
    return total


def test_a_large_sparse_checkpoint_prints_without_its_weights(capsys, tmp_path):
    """A 1B-parameter Llama whose 1.9 GB of bf16 weights are holes in their files: the sizes come from the headers
    (reading the weights would take the memory and the time)."""
    from transformers import LlamaConfig

    from kvgate.common.demo import build_byte_tokenizer, write_tokenizer_files

    h, inter, layers, kv, vocab = 4096, 11008, 4, 8 * 128, 32000
    LlamaConfig(vocab_size=vocab, hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                tie_word_embeddings=False, architectures=["LlamaForCausalLM"]).save_pretrained(str(tmp_path))
    write_tokenizer_files(build_byte_tokenizer(), tmp_path, 4096)
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    stored = _write_sparse_checkpoint(tmp_path, shapes)
    assert stored > 1.9e9
    rows = dict(print_config(capsys, tmp_path, ON_CPU))
    dtype = rows["dtype"].split()[0]  # bfloat16 on CPUs with AVX512-BF16/AMX (hidden 4096), else float32
    assert printed_bytes(rows.items(), "weights") == stored * (1 if dtype == "bfloat16" else 2)  # stored: bf16
    assert f"{len(shapes)} tensors as {dtype}" in rows["weights"]
    per_block = 2 * layers * 16 * 8 * 128 * (2 if dtype == "bfloat16" else 4)
    assert rows["kv_cache_blocks"].startswith(f"{(1 << 30) // per_block} (1024.0 MiB)")
    assert rows["max_model_len"] == "4096  (the model's)"


@pytest.mark.processes
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("draft", [False, True])
def test_print_config_on_cuda(checkpoints, tmp_path, draft):
    """On CUDA the KV cache's size is measured: `--print-config` (its weights allocated, not read) against the
    settings a served engine logs, each in a process of its own as in use."""
    flags = ["--max-model-len", "256"]
    if draft:
        flags += ["--speculative-config", json.dumps({"method": "draft_model", "model": str(checkpoints["draft"]),
                                                      "num_speculative_tokens": 2})]
    model = str(checkpoints["llama"])
    env = dict(os.environ, KVGATE_CACHE_DIR=str(tmp_path))
    r = subprocess.run([KVGATE, "serve", model, "--print-config", *flags], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    printed = [tuple(line.split(None, 1)) for line in r.stdout.splitlines()]
    logged = [tuple(line.split(None, 1)) for line in served_settings(tmp_path, model, flags, env, 300)]
    assert dict(printed)["device"].startswith("cuda") and "measured" in dict(printed)["kv_cache_blocks"]
    assert [row for row in printed if row[0] not in WEIGHT_ROWS] == logged
