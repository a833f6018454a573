"""JSON (and YAML) that kvgate's programs read at start, bounded in size and nesting (common/bounded_json.py,
common/bounded_file.py): a file or flag nested 100000 deep, or too large, or not a regular file, is the program's
one-line error — `kvgate serve: error: ...` with exit 2 for flags and the generation config, the engine's start
error for a model folder's files, `kvgate epp: ...` — never a RecursionError's traceback; at run time a LoRA load
with such an adapter_config.json is a 400 and the server serves on."""

from __future__ import annotations

import json
import os
import subprocess

import httpx
import pytest

from kvgate.common import bounded_json
from kvgate.common.bounded_file import FileLimitError, read_bytes
from kvgate.common.demo import build_demo_model
from tests.procs import KVGATE, KvgateServe

pytestmark = pytest.mark.processes

DEEP = "[" * 100_000 + "]" * 100_000  # what the report sent: json.loads recurses out of its stack
DEEP_FLAG = '{"a": ' * 1000 + "1" + "}" * 1000  # a flag's value is at most 128 KiB (Linux's MAX_ARG_STRLEN)


# --- the helper -------------------------------------------------------------------------------------------------

def test_depth_and_size_are_refused_before_json_recurses():
    assert bounded_json.loads("[" * 64 + "]" * 64, 1000) == eval("[" * 64 + "]" * 64)
    with pytest.raises(bounded_json.JSONLimitError, match="nested deeper than 64 levels"):
        bounded_json.loads("[" * 65 + "]" * 65, 1000)
    with pytest.raises(bounded_json.JSONLimitError, match="nested deeper than 64 levels"):
        bounded_json.loads(DEEP, len(DEEP))
    # brackets inside strings (escaped quotes too) are text, not nesting
    text = json.dumps({"s": "[" * 1000 + '\\"{' * 500, "t": "]]]"})
    assert bounded_json.loads(text, len(text))["t"] == "]]]"
    with pytest.raises(bounded_json.JSONLimitError, match="larger than 10 characters"):
        bounded_json.loads('{"a": 123456}', 10)
    with pytest.raises(bounded_json.JSONLimitError, match="larger than 1 KiB"):
        bounded_json.loads(b"[" + b"1," * 600 + b"1]", 1024)
    for bad in ("{", '{"a": "unterminated [[[[', "]]]"):  # not JSON: json's own error, a ValueError too
        with pytest.raises(ValueError):
            bounded_json.loads(bad, 1000)


def test_files_are_read_within_their_limit_and_only_when_regular(tmp_path):
    (tmp_path / "ok.json").write_text('{"a": [1, 2]}')
    assert bounded_json.read(tmp_path / "ok.json", 100) == {"a": [1, 2]}
    (tmp_path / "big.json").write_text("[" + "1," * 1000 + "1]")
    with pytest.raises(FileLimitError, match="larger than 1 KiB"):
        bounded_json.read(tmp_path / "big.json", 1024)
    os.mkfifo(tmp_path / "fifo")  # opening it for reading would wait for a writer: refused at once instead
    with pytest.raises(FileLimitError, match="not a regular file"):
        read_bytes(tmp_path / "fifo", 1024)
    with pytest.raises(FileLimitError, match="not a regular file"):
        bounded_json.check_file(tmp_path, 1024)
    (tmp_path / "deep.json").write_text(DEEP)
    with pytest.raises(bounded_json.JSONLimitError, match="nested deeper"):
        bounded_json.check_file(tmp_path / "deep.json", len(DEEP))
    with pytest.raises(FileNotFoundError):
        bounded_json.read(tmp_path / "absent.json", 100)


def test_json_read_back_at_run_time_is_bounded_too():
    """The operator's own ConfigMap, the model's tool-call text and an engine's response tail (the EPP's usage):
    nested too deep, each is not what its reader looks for (each was a RecursionError)."""
    from kvgate.engine.server.tool_calls import ToolMode, tool_calls
    from kvgate.engine.server.tool_parsers import HermesToolParser
    from kvgate.epp.extproc import find_usage
    from kvgate.operator.gateway import retain_retired_clusters

    rendered = {"cds.json": {"resources": []}}
    previous = {"data": {"cds.json": DEEP}, "metadata": {"annotations": {}}}
    assert retain_retired_clusters(rendered, previous, 0.0) == (rendered, {})  # was a RecursionError
    assert tool_calls(ToolMode(name="f"), DEEP) is None
    assert HermesToolParser().extract(f"<tool_call>{DEEP}</tool_call>")[1] == []
    assert find_usage(b'data: {"usage": ' + b"[" * 5000 + b"]" * 5000 + b"}\n\n") is None
    assert find_usage(b'data: {"usage": {"prompt_tokens": 3, "completion_tokens": 4}}\n\n') == (3, 4)


# --- kvgate serve: flags and files read at start ------------------------------------------------------------------

def _serve(args: list[str], cache, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([KVGATE, "serve", *args], capture_output=True, text=True, timeout=timeout,
                          env={"KVGATE_CACHE_DIR": str(cache), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})


def _one_error_line(proc: subprocess.CompletedProcess, says: str) -> str:
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert "Traceback" not in proc.stderr and "RecursionError" not in proc.stderr, proc.stderr[-3000:]
    assert errors and errors[-1].startswith("kvgate serve: error: ") and says in errors[-1], proc.stderr[-3000:]
    return errors[-1]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("kvgate-cache")


@pytest.mark.parametrize("what", ["generation-config", "generation-config-size", "override", "speculative",
                                  "kv-events", "sim-profile"])
def test_a_deep_or_large_start_input_is_one_line_and_exit_2(tmp_path, cache, what):
    folder = tmp_path / "gen"
    folder.mkdir()
    flags, says = {
        "generation-config": (["--generation-config", str(folder)], "generation_config.json: nested deeper"),
        "generation-config-size": (["--generation-config", str(folder)], "larger than 16 MiB"),
        "override": (["--override-generation-config", DEEP_FLAG], "--override-generation-config: nested deeper"),
        "speculative": (["--speculative-config", DEEP_FLAG], "--speculative-config: nested deeper"),
        "kv-events": (["--kv-events-config", DEEP_FLAG], "--kv-events-config: nested deeper"),
        "sim-profile": (["--sim-profile", str(folder / "profile.yaml")], "nested deeper than 64 levels"),
    }[what]
    if what == "generation-config-size":
        (folder / "generation_config.json").write_text('{"temperature": 0.5, "pad": "' + "x" * (16 << 20) + '"}')
    else:
        (folder / "generation_config.json").write_text(DEEP)
    (folder / "profile.yaml").write_text(DEEP)
    proc = _serve(["sim", "--backend", "sim", "--port", "1", *flags], cache)
    assert proc.returncode == 2, proc.stderr[-3000:]
    _one_error_line(proc, says)
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-3000:]


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json"])
def test_a_deep_model_file_is_the_engines_one_line_start_error(tmp_path, cache, name):
    """A model folder's files go to transformers' json.loads after bounded_json's check: the engine's start error
    (exit 1, `kvgate serve: error: cannot read ...`), before any weight is read."""
    folder = tmp_path / "model"
    build_demo_model(folder)
    (folder / name).write_text(DEEP)
    proc = _serve([str(folder), "--port", "1", "--engine-loop", "thread"], cache)
    assert proc.returncode == 1, proc.stderr[-3000:]
    _one_error_line(proc, f"{name}: nested deeper than 64 levels")


def test_a_deep_adapter_config_is_a_400_at_run_time(tmp_path, cache):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(DEEP)
    with KvgateServe("sim", "--backend", "sim", "--enable-lora", cache_dir=cache,
                     env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}) as server:
        r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(adapter)},
                       timeout=30)
        assert r.status_code == 400 and "nested deeper than 64 levels" in r.json()["error"]["message"], r.text
        ok = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert ok.status_code == 200


# --- kvgate epp: its config file, manifests and tokenizer folder --------------------------------------------------

def test_kvgate_epp_start_files_are_bounded(tmp_path, cache):
    (tmp_path / "deep.yaml").write_text(DEEP)
    (tmp_path / "big.yaml").write_text("# " + "x" * (1 << 20))
    os.mkfifo(tmp_path / "fifo.yaml")
    tokenizer = tmp_path / "tokenizer"
    build_demo_model(tokenizer)
    (tokenizer / "tokenizer.json").write_text(DEEP)
    for flags, says in ((["--manifests", str(tmp_path / "deep.yaml")], "nested deeper than 64 levels"),
                        (["--config-file", str(tmp_path / "big.yaml")], "larger than 1 MiB"),
                        (["--config-file", str(tmp_path / "fifo.yaml")], "not a regular file"),
                        (["--tokenizer", str(tokenizer)], "tokenizer.json: nested deeper than 64 levels")):
        proc = subprocess.run([KVGATE, "epp", "--endpoints", "127.0.0.1:9", *flags], capture_output=True, text=True,
                              timeout=60, env={**os.environ, "KVGATE_CACHE_DIR": str(cache)})
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("kvgate epp: "), proc.stderr[-2000:]
        assert says in lines[0], lines
