"""engine/loader.py: memory-mapped safetensors copied straight into the parameters. The same weights as the loader
it replaced (kept in bench/engine_load.py as the benchmark's reference), sharded or not, threads or not; the same
load errors; a clear ModelLoadError for every corrupt or hostile header; and `kvgate bench load` end to end."""

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvgate.engine import LLM, ModelLoadError, SamplingParams
from kvgate.bench.engine_load import check_sane, reference_iterate_weights
from kvgate.engine.loader import MAX_HEADER_BYTES, SafetensorsFile, load_hf_config, load_model, open_safetensors
from tests.engine.tiny_models import MOE_FAMILIES

CPU = torch.device("cpu")


def _load(folder, dtype=torch.float32, **kw):
    return load_model(load_hf_config(folder), folder, CPU, dtype, 128, **kw)


def _state(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _copy_folder(folder: Path, dest: Path) -> Path:
    shutil.copytree(folder, dest)
    return dest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_weights_as_the_reference_loader(family, dtype, tiny_model_dir):
    """Each family, in the checkpoint's dtype and converted inside the copy: bit for bit what the old loader (a full
    copy per tensor, then .to(dtype)) put in the parameters, so the engine's output is the same as before."""
    folder, _ = tiny_model_dir(family)
    new = _state(_load(folder, dtype))
    old = _state(_load(folder, dtype, weights=reference_iterate_weights(folder, dtype)))
    _assert_same(new, old)
    assert all(v.dtype == dtype for v in new.values() if v.is_floating_point())


def test_sharded_and_unsharded_give_identical_parameters(tmp_path, tiny_model_dir):
    folder, model = tiny_model_dir("qwen2")
    model.save_pretrained(str(tmp_path / "sharded"), safe_serialization=True, max_shard_size="50KB")
    shards = sorted((tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) >= 3 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    whole = _state(_load(folder))
    _assert_same(whole, _state(_load(tmp_path / "sharded")))
    _assert_same(whole, _state(_load(tmp_path / "sharded", workers=3)))  # copies on a thread pool
    _assert_same(whole, _state(_load(folder, workers=2)))


def test_engine_output_matches_hf_with_a_sharded_bf16_checkpoint(tmp_path, tiny_model_dir):
    """The engine on its loader, a bf16 checkpoint in shards loaded into float32 (the conversion happens in the
    copy): the same greedy tokens as HF's generate on the same (bf16-rounded) weights."""
    from transformers import AutoModelForCausalLM

    from tests.engine.tiny_models import build_tiny_model, hf_greedy

    model = build_tiny_model("llama", tmp_path / "src", seed=5)
    model.to(torch.bfloat16).save_pretrained(str(tmp_path), safe_serialization=True, max_shard_size="60KB")
    assert len(list(tmp_path.glob("*.safetensors"))) >= 2
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tmp_path / "src" / f, tmp_path / f)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    prompts = [[5, 17, 99, 3], list(range(40, 70)), [200] * 9]
    expected = hf_greedy(hf, prompts, 12)
    llm = LLM(str(tmp_path), max_model_len=128, dtype="float32")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected


# -- the load errors the engine always had -------------------------------------------------------------------------

def test_missing_shard(tmp_path, tiny_model_dir):
    _, model = tiny_model_dir("qwen3")
    model.save_pretrained(str(tmp_path), safe_serialization=True, max_shard_size="100KB")
    victim = sorted(tmp_path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(ModelLoadError, match=f"lacks {victim.name}"):
        _load(tmp_path)


def test_an_index_naming_files_outside_the_folder(tmp_path, tiny_model_dir):
    _, model = tiny_model_dir("qwen3")
    model.save_pretrained(str(tmp_path), safe_serialization=True, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "../elsewhere.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="files of the folder itself"):
        _load(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read"):
        _load(tmp_path)


def _rewrite(folder: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    file = folder / "model.safetensors"
    weights = load_file(str(file))
    edit(weights)
    save_file(weights, str(file))


@pytest.mark.parametrize("workers", [1, 2])
def test_unknown_tensor_wrong_shape_and_missing_weights(tmp_path, tiny_model_dir, workers):
    folder, _ = tiny_model_dir("llama")
    extra = _copy_folder(folder, tmp_path / "extra")
    _rewrite(extra, lambda w: w.update({"model.layers.0.mlp.extra_proj.weight": torch.zeros(2, 2)}))
    with pytest.raises(ModelLoadError, match="'model.layers.0.mlp.extra_proj.weight' does not belong"):
        _load(extra, workers=workers)
    shape = _copy_folder(folder, tmp_path / "shape")
    _rewrite(shape, lambda w: w.update({"model.layers.1.self_attn.v_proj.weight": torch.zeros(3, 64)}))
    with pytest.raises(ModelLoadError, match=r"v_proj.weight' has shape \(3, 64\), expected \(32, 64\)"):
        _load(shape, workers=workers)
    missing = _copy_folder(folder, tmp_path / "missing")
    _rewrite(missing, lambda w: w.pop("model.norm.weight"))
    with pytest.raises(ModelLoadError, match="missing weights: model.norm.weight"):
        _load(missing, workers=workers)
    with pytest.raises(ModelLoadError, match="missing weights"):  # through the engine, as before
        LLM(str(missing), max_model_len=64)


@pytest.mark.parametrize("moe_family", MOE_FAMILIES)
def test_moe_experts_load_into_the_stacked_weights(moe_family, tiny_model_dir):
    """Each expert's per-expert checkpoint tensors land in its slice of the stacked w13 (gate rows, then up rows)
    and w2 weights; bit for bit what the reference loader gives."""
    folder, hf = tiny_model_dir(moe_family)
    model = _load(folder)
    _assert_same(_state(model), _state(_load(folder, weights=reference_iterate_weights(folder, torch.float32))))
    hf_experts, ours = hf.model.layers[1].mlp.experts, model.model.layers[1].mlp.experts
    assert torch.equal(ours.w13_weight, hf_experts.gate_up_proj) and torch.equal(ours.w2_weight, hf_experts.down_proj)


def test_moe_missing_or_unknown_expert_tensor(tmp_path, tiny_model_dir):
    folder, _ = tiny_model_dir("qwen3_moe")
    missing = _copy_folder(folder, tmp_path / "missing")
    _rewrite(missing, lambda w: w.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"missing weights: model.layers.2.mlp.experts.w13_weight\[expert 5\]$"):
        _load(missing)
    extra = _copy_folder(folder, tmp_path / "extra")  # an expert past num_experts
    _rewrite(extra, lambda w: w.update({"model.layers.1.mlp.experts.8.down_proj.weight": torch.zeros(64, 48)}))
    with pytest.raises(ModelLoadError, match="'model.layers.1.mlp.experts.8.down_proj.weight' does not belong"):
        _load(extra)
    dense = _copy_folder(folder, tmp_path / "dense")  # layer 0 is dense (mlp_only_layers): it has no experts
    _rewrite(dense, lambda w: w.update({"model.layers.0.mlp.experts.0.gate_proj.weight": torch.zeros(48, 64)}))
    with pytest.raises(ModelLoadError, match="'model.layers.0.mlp.experts.0.gate_proj.weight' does not belong"):
        _load(dense)
    mixtral, _ = tiny_model_dir("mixtral")
    missing = _copy_folder(mixtral, tmp_path / "mixtral")
    _rewrite(missing, lambda w: w.pop("model.layers.1.block_sparse_moe.experts.3.w2.weight"))
    with pytest.raises(ModelLoadError, match=r"missing weights: model.layers.1.mlp.experts.w2_weight\[expert 3\]$"):
        LLM(str(missing), max_model_len=64)


def test_a_tensor_in_two_shards(tmp_path, tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    dup = _copy_folder(folder, tmp_path / "dup")
    from safetensors.torch import save_file

    save_file({"model.norm.weight": torch.ones(64)}, str(dup / "model-extra.safetensors"))
    with pytest.raises(ModelLoadError, match="'model.norm.weight' is in both"):
        _load(dup)


# -- corrupt and hostile files --------------------------------------------------------------------------------------

def _write(path: Path, header, data: bytes = b"", header_len: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)
    return path


def _entry(dtype="F32", shape=(2, 2), offsets=(0, 16)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


HOSTILE = {
    "header length past the end": (dict(header={"a": _entry()}, data=bytes(16), header_len=10_000),
                                   "header length 10000 runs past the end of the file"),
    "huge header length": (dict(header={"a": _entry()}, data=bytes(16), header_len=2**63),
                           f"over the {MAX_HEADER_BYTES >> 20} MiB limit"),
    "offsets out of range": (dict(header={"a": _entry(shape=(4, 4), offsets=(0, 64))}, data=bytes(16)),
                             r"spans bytes \[0, 64\) of a data section of 16 bytes"),
    "offsets past 2**64": (dict(header={"a": _entry(shape=(2**62, 2**62), offsets=(0, 2**66))}, data=bytes(16)),
                           "offsets out of range"),
    "overlapping tensors": (dict(header={"a": _entry(offsets=(0, 16)), "b": _entry(offsets=(8, 24))},
                                 data=bytes(24)), r"tensors 'a' and 'b' overlap \(bytes \[8, 16\)"),
    "shape and size disagree": (dict(header={"a": _entry(shape=(3, 3), offsets=(0, 16))}, data=bytes(16)),
                                "needs 36 bytes, but its data_offsets span 16"),
    "unknown dtype": (dict(header={"a": _entry(dtype="F128")}, data=bytes(16)), "unknown dtype 'F128'"),
    "negative dimension": (dict(header={"a": _entry(shape=(-2, -2))}, data=bytes(16)), "invalid shape"),
    "offsets reversed": (dict(header={"a": _entry(offsets=(16, 0))}, data=bytes(16)), "invalid data_offsets"),
    "not JSON": (dict(header=b"{\"a\": [1, 2", data=bytes(16)), "not valid JSON"),
    "not UTF-8": (dict(header=b"\xff\xfe{}", data=bytes(16)), "not valid JSON"),
    "deeply nested": (dict(header=b"[" * 100_000 + b"]" * 100_000), "not valid JSON"),
    "not an object": (dict(header=[1, 2, 3]), "not a JSON object"),
    "an entry that is not an object": (dict(header={"a": 7}, data=bytes(16)), "entry is not an object"),
    "a key twice": (dict(header=b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
                                b'"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}', data=bytes(8)),
                    "names a key twice"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_headers_are_load_errors(tmp_path, case):
    kwargs, match = HOSTILE[case]
    with pytest.raises(ModelLoadError, match=match):
        SafetensorsFile(_write(tmp_path / "model.safetensors", **kwargs))


def test_files_too_short_or_unreadable(tmp_path):
    (tmp_path / "empty.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="0 bytes, too short"):
        SafetensorsFile(tmp_path / "empty.safetensors")
    (tmp_path / "short.safetensors").write_bytes(b"\x01\x02\x03")
    with pytest.raises(ModelLoadError, match="3 bytes, too short"):
        SafetensorsFile(tmp_path / "short.safetensors")
    (tmp_path / "dir.safetensors").mkdir()
    with pytest.raises(ModelLoadError, match="cannot map"):
        SafetensorsFile(tmp_path / "dir.safetensors")


def test_a_hostile_file_in_a_model_folder_is_a_clean_engine_error(tmp_path, tiny_model_dir):
    folder, _ = tiny_model_dir("qwen2")
    bad = _copy_folder(folder, tmp_path / "m")
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[:len(data) // 2])  # truncated: offsets run past the end
    with pytest.raises(ModelLoadError, match="offsets out of range"):
        LLM(str(bad), max_model_len=64)


def test_views_are_zero_copy_and_a_misaligned_tensor_is_copied_aligned(tmp_path):
    values = torch.arange(6, dtype=torch.float32)
    header = {"__metadata__": {"format": "pt"}, "a": _entry(shape=(2, 3), offsets=(0, 24)),
              "empty": _entry(shape=(0, 5), offsets=(24, 24))}
    raw = json.dumps(header).encode()
    aligned = raw + b" " * (-len(raw) % 8)  # padded as safetensors' writer pads: data starts 8-byte aligned
    f = SafetensorsFile(_write(tmp_path / "ok.safetensors", aligned, values.numpy().tobytes()))
    a = f.tensor("a")
    assert torch.equal(a, values.view(2, 3)) and f.tensor("empty").shape == (0, 5)
    assert f.tensor("a").data_ptr() == a.data_ptr()  # both views are the mapped bytes, not copies
    f.release("a")  # pages dropped from the process; the bytes are read again from the file
    assert torch.equal(a, values.view(2, 3))
    raw += b" " * ((1 - 8 - len(raw)) % 4)  # the data section starts 1 byte past a multiple of 4
    f = SafetensorsFile(_write(tmp_path / "odd.safetensors", raw, values.numpy().tobytes()))
    odd = f.tensor("a")
    assert torch.equal(odd, values.view(2, 3)) and odd.data_ptr() % 4 == 0


def test_open_safetensors_checks_every_header_before_loading(tmp_path, tiny_model_dir):
    _, model = tiny_model_dir("qwen3")
    model.save_pretrained(str(tmp_path), safe_serialization=True, max_shard_size="100KB")
    last = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    last.write_bytes(struct.pack("<Q", 2**40) + b"{}")
    with pytest.raises(ModelLoadError, match=last.name):
        open_safetensors(tmp_path)


# -- kvgate bench load ----------------------------------------------------------------------------------------------

@pytest.mark.processes
def test_bench_load_end_to_end(tmp_path):
    """A tiny checkpoint, every loader and layout once: the numbers come back and pass the bench's own checks."""
    result = tmp_path / "load.json"
    kvgate = str(Path(sys.executable).parent / "kvgate")
    r = subprocess.run([kvgate, "bench", "load", "--size", "tiny", "--rounds", "1", "--mmap-workers", "1",
                        "--checkpoint-dir", str(tmp_path / "ckpt"), "--result-file", str(result)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(result.read_text())
    assert data["problems"] == [] and data["page_cache"] == "warm"
    assert data["checkpoint"]["shard_files"] >= 3
    assert (tmp_path / "ckpt" / "sharded" / "model.safetensors.index.json").is_file()
    runs = data["runs"]
    assert {(x["layout"], x["label"]) for x in runs} == {
        (layout, label) for layout in ("unsharded", "sharded")
        for label in ("transformers", "baseline", "mmap")}
    assert len({x["digest"] for x in runs}) == 1
    for layout, rows in data["summary"].items():
        assert rows["transformers"]["ready_s_vs_transformers"] == 1.0
        assert rows["baseline"]["ready_peak_mib_vs_baseline"] == 1.0
        for row in rows.values():
            assert 0 < row["load_s"] <= row["ready_s"] < 60
            assert row["ready_peak_mib"] >= row["load_peak_mib"] >= 0
    for word in ("transformers", "baseline", "mmap", "ready peak", "every load holds the checkpoint's weights"):
        assert word in r.stdout


def test_bench_load_refuses_numbers_that_are_not_sane():
    good = {"digest": "d", "parameters": 10, "dtypes": ["bfloat16"], "load_s": 0.1, "ready_s": 0.2,
            "load_peak_kib": 100, "ready_peak_kib": 120, "ready_anon_kib": 100, "ready_file_kib": 0,
            "label": "mmap", "layout": "sharded", "round": 0, "device": "cpu"}
    checkpoint = {"parameters": 10, "bytes": 100 * 1024}
    assert check_sane([good, dict(good)], checkpoint, "bfloat16") == []
    for change, words in [({"digest": "e"}, "different weights"), ({"parameters": 9}, "loaded 9 parameters"),
                          ({"dtypes": ["float32"]}, "not bfloat16"), ({"ready_s": 0.05}, "ready 0.05 s"),
                          ({"load_peak_kib": 200}, "load peak 200 KiB"),
                          ({"ready_anon_kib": 10}, "less than the 0.1 MiB of weights")]:
        problems = check_sane([good, {**good, **change}], checkpoint, "bfloat16")
        assert len(problems) == 1 and words in problems[0], (change, problems)
