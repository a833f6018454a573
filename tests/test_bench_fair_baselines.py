"""`kvgate bench engine` and `kvgate bench serve` as GPU figures are recorded with them: the sampling mix, long
contexts, HF at kvgate's own batch size, the bound at the device's spec bandwidth, the environment in every result
file, and the served-to-offline ratio."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.bench.device_spec import spec_bandwidth
from kvgate.bench.engine import hf_batch_sizes, make_context_workload, parse_contexts, parse_hf_batch_sizes
from kvgate.bench.engine_sampling import LOGPROBS_EVERY, REALISTIC, describe_mix, sampling_params_for
from kvgate.bench.result_record import environment
from kvgate.bench.serve import request_sampling
from kvgate.bench.serve_launch import parse_serve_args

KVGATE = str(Path(sys.executable).parent / "kvgate")
ENVIRONMENT_FIELDS = ("commit", "dirty", "date_utc", "device_name", "torch", "triton", "transformers",
                      "cuda_runtime", "driver")


@pytest.mark.parametrize("name, entry, tbps", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 3.35), ("NVIDIA H100 PCIe", "H100 PCIe", 2.0),
    ("NVIDIA H200", "H200", 4.8), ("NVIDIA H200 NVL", "H200", 4.8), ("NVIDIA A100-SXM4-80GB", "A100 80GB", 2.0),
    ("NVIDIA A100 80GB PCIe", "A100 80GB", 2.0)])
def test_spec_bandwidth_by_device_name(name, entry, tbps):
    spec = spec_bandwidth(name)
    assert spec.name == entry and spec.bytes_per_s == tbps * 1e12


@pytest.mark.parametrize("name", ["cpu", "", None, "NVIDIA H100 NVL", "NVIDIA A100-SXM4-40GB", "NVIDIA L4"])
def test_no_spec_bandwidth_for_devices_not_in_the_table(name):
    assert spec_bandwidth(name) is None


def test_hf_batches_as_kvgate_does_unless_sizes_are_given():
    args = argparse.Namespace(hf_batch_size=parse_hf_batch_sizes("match"), num_requests=1024)
    assert hf_batch_sizes(args, 128) == [128]  # never HF at 64 against kvgate at 128
    assert hf_batch_sizes(argparse.Namespace(hf_batch_size="match", num_requests=3), 128) == [3]
    assert hf_batch_sizes(argparse.Namespace(hf_batch_size=parse_hf_batch_sizes("128,64,64"),
                                             num_requests=1024), 256) == [64, 128]
    for bad in ("0", "x", "1,2,3,4,5,6,7,8,9", "5000"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_hf_batch_sizes(bad)
    for bad in ("0", "a", "2000000"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_contexts(bad)


def test_realistic_mix_and_its_record():
    params = sampling_params_for("realistic", 64, 16)
    assert all((p.temperature, p.top_p, p.top_k, p.repetition_penalty) == tuple(REALISTIC.values())
               and p.max_tokens == 16 and p.ignore_eos for p in params)
    mix = describe_mix("realistic", params)
    assert mix["logprobs_requests"] == 64 // LOGPROBS_EVERY and mix["logprobs_share"] == 1 / LOGPROBS_EVERY
    assert mix["greedy_requests"] == 0 and mix["settings"] == REALISTIC
    greedy = describe_mix("greedy", sampling_params_for("greedy", 8, 4))
    assert greedy["greedy_requests"] == 8 and greedy["logprobs_requests"] == 0
    served = request_sampling("realistic", 16)  # the serve bench sends the same mix
    assert sum("logprobs" in s for s in served) == 16 // LOGPROBS_EVERY and all(s["top_k"] == 50 for s in served)


def test_context_prompts_have_the_exact_length_and_are_reproducible():
    a = make_context_workload(3, 700, 151936, 5)
    assert [len(p) for p in a] == [700] * 3 and a == make_context_workload(3, 700, 151936, 5)
    assert a != make_context_workload(3, 700, 151936, 6)


@pytest.mark.processes  # git, for the commit
def test_environment_record_on_cpu():
    env = environment("cpu")
    assert all(k in env for k in ENVIRONMENT_FIELDS)
    assert env["device_type"] == "cpu" and env["cuda_runtime"] is None and env["driver"] is None
    assert env["commit"] and len(env["commit"]) == 40 and env["date_utc"].endswith("+00:00")


def test_serve_args_leave_host_and_port_to_the_bench():
    assert parse_serve_args("--device cpu --max-num-seqs 8") == ["--device", "cpu", "--max-num-seqs", "8"]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_serve_args("--port 9000")


@pytest.mark.processes
def test_bench_engine_realistic_context_result_file(tmp_path):
    """Realistic sampling at two exact context lengths: the mix, each context's results, HF at kvgate's batch
    size, the bound's bandwidths (no spec on a CPU) and the environment, all in the result file."""
    out = tmp_path / "r.json"
    r = subprocess.run([KVGATE, "bench", "engine", "--num-requests", "3", "--output-len", "3", "--context", "24,40",
                        "--sampling", "realistic", "--baselines", "batched", "--max-num-seqs", "2",
                        "--result-file", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    d = json.loads(out.read_text())
    assert d["sampling"]["mix"] == "realistic" and d["sampling"]["logprobs_requests"] == 1
    assert set(d["by_context"]) == {"24", "40"}
    for context, run in d["by_context"].items():
        res = run["results"]
        assert res["context_tokens"] == int(context)
        assert res["kvgate"]["max_num_seqs"] == 2 and res["hf_best"]["batch_size"] == 2 and "hf_batched_2" in res
        assert res["kvgate"]["decode"]["fraction_of_spec_bound"] is None
    assert d["bandwidth"]["spec_gbs"] is None and d["bandwidth"]["copy_gbs"] > 0
    assert all(k in d["environment"] for k in ENVIRONMENT_FIELDS)
    assert "no spec bandwidth" in r.stdout and "sampled (temperature 0.7" in r.stdout


@pytest.mark.processes
def test_bench_serve_against_a_launched_server_and_offline(tmp_path):
    out = tmp_path / "s.json"
    r = subprocess.run([KVGATE, "bench", "serve", "--serve-model", "demo", "--serve-args",
                        "--engine-loop thread --max-num-seqs 4 --max-model-len 128", "--num-prompts", "6",
                        "--random-input-len", "24", "--random-output-len", "4", "--max-concurrency", "4",
                        "--sampling", "realistic", "--compare-offline", "--serve-start-timeout", "120",
                        "--result-file", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    d = json.loads(out.read_text())
    assert d["completed"] == 6 and d["failed"] == 0 and d["total_output_tokens"] == 24
    assert 0 < d["ttft_ms"]["p50"] <= d["ttft_ms"]["p99"] and d["itl_ms"]["p50"] > 0
    assert d["offline"]["output_tokens"] == 24 and d["served_vs_offline"] > 0
    assert d["sampling"] == "realistic" and d["environment"]["device_type"] == "cpu"
    assert "served / offline output tok/s" in r.stdout


def test_compare_offline_needs_a_launched_server():
    from kvgate.bench.serve import add_bench_serve_parser

    parser = argparse.ArgumentParser()
    add_bench_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--compare-offline"])
    with pytest.raises(SystemExit, match="--serve-model"):
        args.func(args)
