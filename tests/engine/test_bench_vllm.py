"""`kvgate bench engine --baselines vllm`: the refusal without a vLLM interpreter, the JSON contract between the bench
and bench/vllm_generate.py (checked against a stand-in vllm package), and a tiny workload through the real vLLM where
$KVGATE_VLLM_PYTHON names an interpreter that has it (docs/benchmarks.md says how to install one)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.bench.engine import parse_baselines
from kvgate.bench.engine_vllm import SCRIPT, run_vllm, vllm_request
from kvgate.bench.vllm_generate import read_request
from kvgate.cli import main
from kvgate.common.errors import ConfigError

VLLM_PYTHON = os.environ.get("KVGATE_VLLM_PYTHON", "")

# A stand-in for vllm: echoes each prompt's last token output_len times, and prints to stdout as vLLM's logging does.
FAKE_VLLM = '''
__version__ = "0.0-fake"
print("INFO vllm log line on stdout")


class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos=False, detokenize=True):
        assert temperature == 0.0 and detokenize is False
        self.max_tokens = max_tokens


class _Completion:
    def __init__(self, ids):
        self.token_ids = ids


class _Output:
    def __init__(self, ids):
        self.outputs = [_Completion(ids)]


class LLM:
    def __init__(self, model, dtype, max_model_len, skip_tokenizer_init, seed):
        assert skip_tokenizer_init
        print("INFO engine started")

    def generate(self, prompts, params, use_tqdm=True):
        return [_Output([p["prompt_token_ids"][-1]] * params.max_tokens) for p in prompts]

    def reset_prefix_cache(self):
        pass
'''


def test_baselines_parse_hf_runs_and_vllm():
    assert parse_baselines("single,batched") == (["single", "batched"], False)
    assert parse_baselines("both,vllm") == (["single", "batched"], True)
    assert parse_baselines("vllm") == ([], True)
    assert parse_baselines("none") == ([], False)
    with pytest.raises(ConfigError, match="unknown baseline 'vlm'"):
        parse_baselines("batched,vlm")


def test_vllm_baseline_without_an_interpreter_is_refused_in_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("KVGATE_VLLM_PYTHON", raising=False)
    assert main(["bench", "engine", "--baselines", "vllm"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--vllm-python" in err and "Traceback" not in err
    assert main(["bench", "engine", "--baselines", "vllm", "--vllm-python", str(tmp_path / "none")]) == 2
    assert "not an executable file" in capsys.readouterr().err


def test_the_request_the_script_reads_is_well_formed():
    request = vllm_request("/models/demo", "float32", [[1, 2, 3], [4] * 10], 8)
    assert read_request(json.dumps(request)) == request
    assert request["max_model_len"] == 18 and request["dtype"] == "float32"
    for bad in ({**request, "prompts": []}, {**request, "prompts": [["a"]]}, {k: v for k, v in request.items()
                                                                            if k != "output_len"}):
        with pytest.raises(ValueError):
            read_request(json.dumps(bad))


@pytest.mark.processes
def test_the_script_writes_its_result_alone_on_stdout(tmp_path, monkeypatch):
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    (tmp_path / "vllm" / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n"
                                                 "    return {'prompt_token_ids': prompt_token_ids}\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    out = run_vllm(sys.executable, vllm_request(str(tmp_path), "float32", [[5, 6, 7], [9]], 3), timeout=60)
    assert out["outputs"] == [[7, 7, 7], [9, 9, 9]] and out["vllm_version"] == "0.0-fake" and out["seconds"] >= 0
    failed = subprocess.run([sys.executable, str(SCRIPT)], input="{}", capture_output=True, text=True, timeout=60)
    assert failed.returncode != 0 and failed.stdout == ""


@pytest.mark.processes
@pytest.mark.skipif(not Path(VLLM_PYTHON).is_file(), reason="$KVGATE_VLLM_PYTHON names no interpreter with vLLM")
def test_bench_engine_against_vllm(tmp_path):
    result = tmp_path / "result.json"
    env = dict(os.environ, KVGATE_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([str(Path(sys.executable).parent / "kvgate"), "bench", "engine", "--num-requests", "3",
                        "--output-len", "4", "--max-prompt-len", "40", "--baselines", "vllm", "--vllm-python",
                        VLLM_PYTHON, "--result-file", str(result)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    vllm = json.loads(result.read_text())["results"]["vllm"]
    assert vllm["output_tokens_per_s"] > 0 and vllm["kvgate_speedup"] > 0
    assert vllm["greedy_identical_to_kvgate"] == "3/3", vllm
    assert "against vLLM" in r.stdout
