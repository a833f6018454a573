"""Settings the engine derives when not given (engine/auto_config.py): CPU threads from cgroup trees, dtype by GPU,
max_model_len and max_num_seqs fitted to the KV cache, and `kvgate serve --print-config`."""

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvgate.engine import auto_config
from kvgate.engine.auto_config import (Settings, available_cpus, cuda_kv_cache_bytes, resolve_cpu_threads,
                                       resolve_dtype, resolve_step_budget)
from kvgate.engine.config import EngineConfig
from kvgate.common.errors import ConfigError
from kvgate.engine.llm import LLM
from kvgate.engine.sampling_params import SamplingParams
from kvgate.common.processes import free_port, stop_group

KVGATE = str(Path(sys.executable).parent / "kvgate")


def _tree(root: Path, files: dict) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.mark.parametrize("files, affinity, threads", [
    ({"cpu.max": "max 100000\n"}, 6, 6),  # v2, no quota: the affinity
    ({"cpu.max": "150000 100000\n"}, 8, 2),  # v2, 1.5 CPUs round up
    ({"cpu.max": "400000 100000\n"}, 3, 3),  # affinity smaller than the quota
    ({"cpu.max": "20000 100000\n"}, 4, 1),  # a fifth of a CPU: at least one thread
    ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 16, 3),  # v1
    ({"cpu,cpuacct/cpu.cfs_quota_us": "250000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, 16, 3),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, 5, 5),  # v1, no quota
    ({}, 7, 7),  # no CPU controller at all
    # files that do not parse: no quota, the affinity bounds the threads (the engine still starts)
    ({"cpu.max": "lots 100000\n"}, 4, 4),
    ({"cpu.max": "100000 0\n"}, 4, 4),
    ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "\n"}, 3, 3),
])
def test_threads_from_cgroup_quota_and_affinity(tmp_path, files, affinity, threads):
    n, why = available_cpus(affinity, _tree(tmp_path, files))
    assert n == threads
    assert f"affinity {affinity}" in why


def test_threads_given_then_omp_num_threads_then_derived():
    assert resolve_cpu_threads(3, {"OMP_NUM_THREADS": "5"}) == (3, "given")
    assert resolve_cpu_threads(None, {"OMP_NUM_THREADS": "5"}) == (5, "OMP_NUM_THREADS")
    n, why = resolve_cpu_threads(None, {"OMP_NUM_THREADS": "bad"})  # not a count: derived from this process
    assert n == available_cpus(len(os.sched_getaffinity(0)))[0] and "affinity" in why


@pytest.mark.parametrize("checkpoint, capability, dtype", [
    ("float32", (8, 0), torch.bfloat16), ("float32", (7, 5), torch.float16), ("bfloat16", (7, 0), torch.float16),
    ("float16", (9, 0), torch.float16), ("bfloat16", (9, 0), torch.bfloat16),
])
def test_gpu_dtype_falls_back_to_fp16_without_bf16(monkeypatch, checkpoint, capability, dtype):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    config = EngineConfig(model="m")
    got, why = resolve_dtype(config, SimpleNamespace(dtype=checkpoint), torch.device("cuda"))
    assert got == dtype
    assert ("no bfloat16" in why) == (dtype == torch.float16 and checkpoint != "float16")


CPUINFO = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f {}\nbogomips\t: 4000\n"


@pytest.mark.parametrize("extra, hidden, dtype", [
    ("avx512_bf16", 896, "bfloat16"), ("amx_bf16 amx_tile", 512, "bfloat16"),
    ("avx512_bf16", 256, "float32"),  # the demo's size: bfloat16 measured no clear gain
    ("", 4096, "float32"),  # no bf16 instructions
])
def test_cpu_dtype_by_flags_and_model_size(extra, hidden, dtype):
    name, why = auto_config.cpu_dtype(hidden, auto_config.cpu_bf16_flags(CPUINFO.format(extra)))
    assert name == dtype and why.startswith(dtype)


def test_test_models_stay_float32_on_any_cpu(tiny_model_dir):
    """The suite compares with HF in float32 through the default dtype: whatever this CPU's flags, tiny models and
    the demo resolve to float32."""
    from kvgate.engine.loader import load_hf_config
    from kvgate.engine.llm import resolve_model_path

    for path in (str(tiny_model_dir("qwen2")[0]), resolve_model_path("demo")):
        hidden = load_hf_config(path).hidden_size
        assert auto_config.cpu_dtype(hidden, ["avx512_bf16", "amx_bf16"])[0] == "float32"
        assert resolve_dtype(EngineConfig(model=path), load_hf_config(path), torch.device("cpu"))[0] == torch.float32
    assert resolve_dtype(EngineConfig(model="m", dtype="bf16"), None, torch.device("cpu")) == (torch.bfloat16, "given")


def test_step_budget_default_given_and_without_chunked_prefill():
    s = Settings()
    assert resolve_step_budget(EngineConfig(model="m"), 4096, s).max_num_batched_tokens == 2048
    assert resolve_step_budget(EngineConfig(model="m", max_num_batched_tokens=64), 4096, s).max_num_batched_tokens == 64
    no_chunks = EngineConfig(model="m", enable_chunked_prefill=False)
    assert resolve_step_budget(no_chunks, 4096, s).max_num_batched_tokens == 4096
    assert [x.source for x in s.items][1] == "given" and "chunked prefill" in s.items[2].source


def test_long_prefill_token_threshold_flag_and_its_errors():
    """vLLM's flag name and default (0: no cap); a cap needs chunked prefill, and is a count."""
    import argparse

    from kvgate.engine.cli_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args("m", parser.parse_args([])).long_prefill_token_threshold == 0
    given = parser.parse_args(["--long-prefill-token-threshold", "256"])
    assert engine_config_from_args("m", given).long_prefill_token_threshold == 256
    with pytest.raises(ConfigError, match="integer >= 0"):
        EngineConfig(model="m", long_prefill_token_threshold=-1)
    with pytest.raises(ConfigError, match="needs chunked prefill"):
        EngineConfig(model="m", long_prefill_token_threshold=256, enable_chunked_prefill=False)


GiB = 1 << 30


@pytest.mark.parametrize("total,own,free,peak,utilization,expected", [
    # Alone on an 80 GiB GPU: 0.9 of it less its 2 GiB of weights and 1 GiB of activations.
    (80 * GiB, 2 * GiB, 77 * GiB, 1 * GiB, 0.9, (69 * GiB, False)),
    # A second engine at 0.45 beside one that holds 36 GiB gets its own share, not 0.45 less the first's.
    (80 * GiB, 2 * GiB, 42 * GiB, 1 * GiB, 0.45, (33 * GiB, False)),
    # Where others leave less free than the share, the cache gets what is free, and says so.
    (80 * GiB, 2 * GiB, 20 * GiB, 1 * GiB, 0.9, (19 * GiB, True)),
    # Nothing left: not positive (the runner's ConfigError).
    (80 * GiB, 2 * GiB, 1 * GiB, 1 * GiB, 0.9, (0, True)),
    (80 * GiB, 2 * GiB, 77 * GiB, 2 * GiB, 0.05, (0, False)),
])
def test_kv_cache_bytes_from_gpu_memory_utilization(total, own, free, peak, utilization, expected):
    """vLLM's --gpu-memory-utilization: a per-engine share of the device (weights + activations + KV cache)."""
    assert cuda_kv_cache_bytes(total, own, free, peak, utilization) == expected


def test_gpu_memory_utilization_and_kv_cache_memory_bytes_flags():
    """vLLM's names: --gpu-memory-utilization in (0, 1] (default 0.9), --kv-cache-memory-bytes as
    --kv-cache-memory."""
    import argparse

    from kvgate.engine.cli_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_engine_args(parser)
    assert engine_config_from_args("m", parser.parse_args([])).gpu_memory_utilization == 0.9
    config = engine_config_from_args("m", parser.parse_args(["--gpu-memory-utilization", "0.45",
                                                            "--kv-cache-memory-bytes", "1073741824"]))
    assert (config.gpu_memory_utilization, config.kv_cache_memory) == (0.45, GiB)
    for bad in ("0", "1.5", "-0.1", "nan", "half"):
        with pytest.raises(argparse.ArgumentError, match=r"must be a number in \(0, 1\]"):
            parser.parse_args(["--gpu-memory-utilization", bad])
    with pytest.raises(ConfigError, match="gpu_memory_utilization must be in"):
        EngineConfig(model="m", gpu_memory_utilization=0.0)


def test_max_model_len_and_max_num_seqs_lowered_to_a_small_kv_cache():
    llm = LLM("demo", kv_cache_memory=1 << 20)  # the demo model in float32: 16 blocks of 16 tokens in 1 MiB
    engine = llm.engine
    assert engine.runner.num_blocks == 16
    assert engine.max_model_len == 16 * 16 < engine.hf_config.max_position_embeddings
    assert engine.config.max_num_seqs == 16 and engine.scheduler.max_num_seqs == 16
    assert "the model's 4096, lowered to what the KV cache holds" in engine.settings.get("max_model_len").source
    assert "lowered to the KV cache's 16 blocks" in engine.settings.get("max_num_seqs").source
    out = llm.generate(["a"] * 40, SamplingParams(max_tokens=4))  # more than max_num_seqs: they wait their turn
    assert [len(o.outputs[0].token_ids) for o in out] == [4] * 40
    with pytest.raises(ConfigError, match="fewer than max_model_len 1024"):
        LLM("demo", kv_cache_memory=1 << 20, max_model_len=1024)


def test_given_values_are_kept():
    engine = LLM("demo", kv_cache_memory=1 << 20, max_num_seqs=64, max_model_len=256).engine
    assert (engine.config.max_num_seqs, engine.max_model_len) == (64, 256)
    assert engine.settings.get("max_num_seqs").source == engine.settings.get("max_model_len").source == "given"


@pytest.mark.processes
def test_serve_print_config_prints_every_setting_and_exits(tmp_path):
    env = dict(os.environ, KVGATE_CACHE_DIR=str(tmp_path))
    r = subprocess.run([KVGATE, "serve", "demo", "--print-config", "--max-num-seqs", "8", "--cpu-threads", "1",
                        "--port", "1"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line for line in r.stdout.splitlines()}
    assert set(rows) == {"device", "cpu_threads", "dtype", "weights", "max_num_batched_tokens", "kv_cache_blocks",
                         "max_model_len", "max_num_seqs"}
    assert rows["max_num_seqs"].split()[1:] == ["8", "(given)"]
    assert rows["cpu_threads"].split()[1:] == ["1", "(given)"]
    assert "float32" in rows["dtype"] and "(given)" not in rows["dtype"]
    assert "4096  (the model's)" in rows["max_model_len"]
    assert "serving" not in r.stderr  # it never started the server (port 1 could not be bound anyway)
    bad = subprocess.run([KVGATE, "serve", "demo", "--print-config", "--kv-cache-memory", "1MiB", "--max-model-len",
                          "1024"], capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 1 and "fewer than max_model_len" in bad.stderr


def served_settings(tmp_path: Path, model: str, flags: list[str], env: dict, timeout_s: float) -> list[str]:
    """`kvgate serve MODEL FLAGS` started until `engine ready` (or its exit, or timeout_s), stopped: the settings
    lines its engine logged (what follows "auto_config: config: "), in order."""
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([KVGATE, "--log-level", "info", "serve", model, "--port", str(free_port("127.0.0.1")),
                                 *flags], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            deadline = time.monotonic() + timeout_s
            while "engine ready" not in log_path.read_text() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
        finally:
            stop_group(proc)
    return [line.split("auto_config: config: ", 1)[1] for line in log_path.read_text().splitlines()
            if "auto_config: config:" in line]


@pytest.mark.processes
def test_served_engine_logs_its_settings_first(tmp_path):
    """The engine process (spawned) logs at the server's --log-level: its settings come before `engine ready`."""
    env = dict(os.environ, KVGATE_CACHE_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    lines = served_settings(tmp_path, "demo", ["--kv-cache-memory", "64MiB"], env, 90)
    assert [line.split()[0] for line in lines] == ["device", "cpu_threads", "dtype", "max_num_batched_tokens",
                                                   "kv_cache_blocks", "max_model_len", "max_num_seqs"]
    assert lines[1].split()[1:] == ["1", "(OMP_NUM_THREADS)"]
    assert lines[4].split()[1:] == ["1024", "(64.0", "MiB)", "(given", "(kv_cache_memory))"]
