"""Tensor parallelism (engine/distributed/, engine/models/parallel_linear.py).

- The parallel layers against their plain torch counterparts, ranks as threads over a real gloo group.
- Greedy outputs at tensor_parallel_size 2 and 4 token-identical to HF transformers' (which TP=1 matches:
  test_hf_parity.py), every family, in test_hf_parity's scheduling modes. The default suite runs a subset that
  still covers every family at TP=2, every mode, and KV-head replication at TP=4; KVGATE_TP_FULL_MATRIX=1 runs
  every family x mode x {2, 4}.
- A rank SIGKILLed mid-generation: the engine raises a clear error at once; through a real `kvgate serve`, /health
  leaves 200 within a second and the running request fails.
- n-gram speculative decoding's verification steps at TP=2 match HF; `--print-config -tp 2` prints rank 0's sizes.
- Bad input: a size that does not divide the heads is a one-line ModelLoadError; flags that TP does not support
  are ConfigErrors.
- On two GPUs (marker cuda; skipped otherwise): NCCL, CUDA graphs capturing the all-reduces, token-identical to one
  GPU.
"""

from __future__ import annotations

import datetime
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kvgate.common.errors import ConfigError, ModelLoadError
from kvgate.engine import LLM, SamplingParams
from kvgate.engine.config import EngineConfig
from kvgate.engine.distributed.group import TensorParallelGroup, building_for
from kvgate.engine.distributed.workers import TensorParallelError
from kvgate.engine.models import parallel_linear as pl
from tests.engine.test_hf_parity import MAX_NEW, MODES, make_prompts
from tests.engine.tiny_models import FAMILIES, MOE_FAMILIES, hf_greedy, hf_greedy_by_family, make_config
from tests.procs import KvgateServe

# -- the layers, ranks as threads ----------------------------------------------------------------------------------


def run_ranks(size: int, fn) -> list:
    """fn(group) on `size` threads, each a rank of one gloo group over an in-process store; results by rank."""
    store = dist.HashStore()
    results: list = [None] * size
    errors: list = []

    def rank_main(rank: int) -> None:
        try:
            pg = dist.ProcessGroupGloo(dist.PrefixStore("t", store), rank, size, datetime.timedelta(seconds=30))
            results[rank] = fn(TensorParallelGroup(rank, size, pg))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return results


def load(layer: nn.Module, param: str, tensor: torch.Tensor, shard=None, dest: torch.Tensor | None = None) -> None:
    """What load_weights does for one checkpoint tensor: this rank's slice into (a slice of) the parameter."""
    dest = getattr(layer, param).data if dest is None else dest
    dest, tensor = layer.shard_weight(param, dest, tensor, shard)
    dest.copy_(tensor)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_row_parallel_matches_linear(size, bias):
    torch.manual_seed(0)
    full = nn.Linear(24, 10, bias=bias)
    x = torch.randn(5, 24)

    def rank(tp):
        layer = pl.RowParallelLinear(24, 10, bias, tp, "in")
        load(layer, "weight", full.weight.data)
        if bias:
            load(layer, "bias", full.bias.data)
        xs = x.narrow(1, tp.rank * layer.local_in, layer.local_in)  # a column-parallel layer's output slice
        return layer(xs.contiguous())

    for y in run_ranks(size, rank):
        torch.testing.assert_close(y, full(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("size", [2, 4])
def test_merged_column_and_row_make_the_mlp(size):
    """gate_up column-parallel, down row-parallel: every rank ends with the whole MLP's output."""
    torch.manual_seed(1)
    gate, up, down = nn.Linear(16, 12, bias=False), nn.Linear(16, 12, bias=False), nn.Linear(12, 16, bias=False)
    x = torch.randn(3, 16)
    expected = down(F.silu(gate(x)) * up(x))

    def rank(tp):
        gate_up = pl.MergedColumnParallelLinear(16, 12, False, tp, "intermediate_size")
        local = gate_up.local_size
        load(gate_up, "weight", gate.weight.data, 0, gate_up.weight.data[:local])
        load(gate_up, "weight", up.weight.data, 1, gate_up.weight.data[local:])
        row = pl.RowParallelLinear(12, 16, False, tp, "intermediate_size")
        load(row, "weight", down.weight.data)
        g, u = gate_up(x).split(local, dim=-1)
        return row(F.silu(g) * u)

    for y in run_ranks(size, rank):
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("size,kv_heads", [(2, 2), (4, 2), (4, 1), (2, 4)])
def test_qkv_parallel_takes_each_ranks_heads(size, kv_heads):
    """Query heads split; KV heads split, or replicated (the one KV head a rank's query heads use) when fewer."""
    torch.manual_seed(2)
    heads, d, hidden = 4, 3, 8
    q, k, v = (nn.Linear(hidden, n * d, bias=True) for n in (heads, kv_heads, kv_heads))
    x = torch.randn(2, hidden)

    def rank(tp):
        layer = pl.QKVParallelLinear(hidden, d, heads, kv_heads, True, tp)
        qs, kvs = layer.num_heads * d, layer.num_kv_heads * d
        for name, full, rows in (("q", q, slice(0, qs)), ("k", k, slice(qs, qs + kvs)),
                                 ("v", v, slice(qs + kvs, qs + 2 * kvs))):
            load(layer, "weight", full.weight.data, name, layer.weight.data[rows])
            load(layer, "bias", full.bias.data, name, layer.bias.data[rows])
        out = layer(x)
        return out.split([qs, kvs, kvs], dim=-1), layer.kv_start

    group = heads // kv_heads  # query heads per KV head
    for r, ((qo, ko, vo), kv_start) in enumerate(run_ranks(size, rank)):
        local_heads = heads // size
        torch.testing.assert_close(qo, q(x)[:, r * local_heads * d:(r + 1) * local_heads * d])
        # the KV heads this rank holds are those its query heads attend with
        assert kv_start == (r * local_heads) // group
        n = ko.shape[1] // d
        torch.testing.assert_close(ko, k(x)[:, kv_start * d:(kv_start + n) * d])
        torch.testing.assert_close(vo, v(x)[:, kv_start * d:(kv_start + n) * d])


@pytest.mark.parametrize("size,vocab", [(2, 10), (4, 10), (3, 7)])
def test_vocab_parallel_embedding_and_lm_head(size, vocab):
    """Padded vocabulary slices (vocab not divisible by the size): the lookup and the gathered logits are exact."""
    torch.manual_seed(3)
    emb, head = nn.Embedding(vocab, 6), nn.Linear(6, vocab, bias=False)
    ids = torch.tensor([0, vocab - 1, 3, 5, 1])
    h = torch.randn(4, 6)

    def rank(tp):
        e, lm = pl.VocabParallelEmbedding(vocab, 6, tp), pl.ParallelLMHead(vocab, 6, tp)
        for layer, full in ((e, emb.weight.data), (lm, head.weight.data)):
            layer.weight.data.fill_(float("nan"))  # padding rows: never looked up, their logits cut
            load(layer, "weight", full)
        return e(ids), lm(h)

    for x, logits in run_ranks(size, rank):
        torch.testing.assert_close(x, emb(ids))
        assert logits.shape == (4, vocab)
        torch.testing.assert_close(logits, head(h), rtol=1e-5, atol=1e-5)


def test_fused_moe_shards_the_intermediate_dim():
    from kvgate.engine.models.moe import FusedMoE

    torch.manual_seed(4)
    experts, inter, hidden = 4, 8, 6
    w13, w2 = torch.randn(experts, 2 * inter, hidden), torch.randn(experts, hidden, inter)
    x, logits = torch.randn(5, hidden), torch.randn(5, experts)
    with building_for(TensorParallelGroup()):
        full = FusedMoE(experts, 2, hidden, inter, renormalize=True, weights_in_fp32=True)
    full.w13_weight.data.copy_(w13)
    full.w2_weight.data.copy_(w2)
    expected = full(x, logits)

    def rank(tp):
        with building_for(tp):
            moe = FusedMoE(experts, 2, hidden, inter, renormalize=True, weights_in_fp32=True)
        local = moe.intermediate_size
        for e in range(experts):  # each expert's gate, up and down tensors as the checkpoint has them
            load(moe, "w13_weight", w13[e, :inter], 0, moe.w13_weight.data[e, :local])
            load(moe, "w13_weight", w13[e, inter:], 1, moe.w13_weight.data[e, local:])
            load(moe, "w2_weight", w2[e], None, moe.w2_weight.data[e])
        return moe(x, logits)

    for y in run_ranks(2, rank):
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


def test_indivisible_sizes_are_load_errors():
    tp = TensorParallelGroup(0, 3)
    with pytest.raises(ModelLoadError, match="num_attention_heads \\(4\\) is not divisible by tensor_parallel_size 3"):
        pl.attention_heads(4, 2, tp)
    with pytest.raises(ModelLoadError, match="not a multiple of num_key_value_heads"):
        pl.attention_heads(6, 4, TensorParallelGroup(0, 6))
    with pytest.raises(ModelLoadError, match="intermediate_size \\(10\\) is not divisible"):
        pl.MergedColumnParallelLinear(4, 10, False, TensorParallelGroup(0, 4), "intermediate_size")


def test_plain_modules_without_tensor_parallelism():
    """TP=1 builds the very modules it built before (nn.Linear, nn.Embedding): nothing changes without it."""
    from kvgate.engine.loader import build_model

    config = make_config("llama")
    config.architectures = ["LlamaForCausalLM"]
    model = build_model(config, torch.device("meta"), torch.float32, 64)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert type(attn.qkv_proj) is nn.Linear and type(attn.o_proj) is nn.Linear
    assert type(mlp.gate_up_proj) is nn.Linear and type(mlp.down_proj) is nn.Linear
    assert type(model.model.embed_tokens) is nn.Embedding and type(model.lm_head) is nn.Linear


@pytest.mark.parametrize("args,match", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive integer"),
    (dict(tensor_parallel_size=2, enable_lora=True), "LoRA adapters are not supported"),
    (dict(tensor_parallel_size=2, backend="sim"), "needs the torch backend"),
])
def test_config_errors(args, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(model="m", **args)


def test_cli_flag():
    import argparse

    from kvgate.engine.cli_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--tensor-parallel-size", "2"])
    assert engine_config_from_args("m", args).tensor_parallel_size == 2
    assert engine_config_from_args("m", parser.parse_args(["-tp", "4"])).tensor_parallel_size == 4


# -- real engines: worker processes --------------------------------------------------------------------------------

ALL = [(f, m, tp) for f in FAMILIES + MOE_FAMILIES for m in MODES for tp in (2, 4)]
# Every family at TP=2, each in another mode so every mode runs; TP=4 (query heads 1 a rank, the 2 KV heads
# replicated, the vocabulary padded) for a dense and an MoE family.
SUBSET = [("llama", "prefix-caching", 2), ("mistral", "no-prefix-caching", 2), ("qwen2", "chunked-prefill", 2),
          ("qwen3", "preemption", 2), ("qwen3_moe", "async-chunked-prefill", 2), ("mixtral", "async-preemption", 2),
          ("llama", "async-preemption", 4), ("qwen3_moe", "chunked-prefill", 4)]
MATRIX = ALL if os.environ.get("KVGATE_TP_FULL_MATRIX") == "1" else SUBSET


@pytest.fixture(scope="module")
def hf_reference(tiny_model_dir):
    return hf_greedy_by_family(tiny_model_dir, make_prompts(), MAX_NEW)


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.parametrize("family,mode,tp", MATRIX, ids=[f"{f}-{m}-tp{t}" for f, m, t in MATRIX])
def test_greedy_matches_hf(family, mode, tp, tiny_model_dir, hf_reference):
    folder, _ = tiny_model_dir(family)
    llm = LLM(str(folder), max_model_len=128, tensor_parallel_size=tp, **MODES[mode])
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in make_prompts()], params)
        expected = hf_reference(family)
        for i, o in enumerate(outs):
            assert o.outputs[0].token_ids == expected[i], f"{family}/{mode}/tp{tp}: prompt {i} diverges from HF"
        if mode.endswith("preemption"):
            assert llm.engine.stats().num_preemptions > 0, "the small KV pool should have forced preemption"
        if mode == "prefix-caching":  # served from the cache the second time, on every rank's cache alike
            again = llm.generate([{"prompt_token_ids": p} for p in make_prompts()], params)
            assert [o.outputs[0].token_ids for o in again] == expected
            assert sum(o.num_cached_tokens for o in again) > 0
    finally:
        llm.engine.close()
    workers = llm.engine.runner.workers
    assert all(p.poll() is not None for p in workers.procs), "close() left a worker running"


@pytest.mark.processes
@pytest.mark.slow
def test_killed_rank_fails_the_engine_at_once(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    llm = LLM(str(folder), max_model_len=128, tensor_parallel_size=2)
    engine = llm.engine
    try:
        params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
        for i, prompt in enumerate(make_prompts()[:4]):
            engine.add_request(f"r{i}", prompt, params)
        for _ in range(3):
            engine.step()
        worker = engine.runner.workers.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(TensorParallelError, match=rf"rank 1 \(pid {worker.pid}\) died \(killed by SIGKILL\)"):
            for _ in range(100):
                engine.step()
        assert time.monotonic() - started < 5.0
        with pytest.raises(TensorParallelError):  # and every later step
            engine.step()
        # a collective that was waiting on the dead rank fails at once, and is explained the same way
        with pytest.raises(RuntimeError) as failed:
            engine.runner.tp.all_reduce(torch.ones(4))
        assert "rank 1" in str(engine.runner.workers.explain(failed.value))
    finally:
        engine.close()


def _descendants(pid: int) -> list[int]:
    """pids of `pid`'s children, grandchildren, ... (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        children = [c for c, parent in parents.items() if parent == p]
        found += children
        frontier += children
    return found


def _worker_pids(server_pid: int) -> list[int]:
    pids = []
    for pid in _descendants(server_pid):
        try:
            if b"kvgate.engine.distributed.worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(pid)
        except OSError:
            pass
    return pids


@pytest.mark.processes
@pytest.mark.slow
def test_killed_rank_turns_the_server_unhealthy(tiny_model_dir, tmp_path):
    folder, _ = tiny_model_dir("llama")
    with KvgateServe(str(folder), "--tensor-parallel-size", "2", "--max-model-len", "256", "--device", "cpu",
                     "--keep-alive-on-engine-death", cache_dir=tmp_path) as server:
        workers = _worker_pids(server.proc.pid)
        assert len(workers) == 1, server.log()
        result: dict = {}

        def long_request():
            result["response"] = httpx.post(server.url + "/v1/completions", timeout=60, json={
                "model": str(folder), "prompt": [1, 2, 3], "max_tokens": 200, "ignore_eos": True})

        client = threading.Thread(target=long_request)
        client.start()
        time.sleep(1.0)  # the request is being generated
        os.kill(workers[0], signal.SIGKILL)
        killed = time.monotonic()
        status = 200
        while time.monotonic() - killed < 1.0:
            status = httpx.get(server.url + "/health", timeout=1.0).status_code
            if status != 200:
                break
            time.sleep(0.05)
        assert status != 200, f"/health still 200 a second after rank 1 was killed:\n{server.log()}"
        client.join(30)
        response = result["response"]
        assert response.status_code >= 500, response.text
        assert "tensor-parallel rank 1" in response.text and "SIGKILL" in response.text, response.text


@pytest.mark.processes
@pytest.mark.slow
def test_workers_end_with_rank_0(tiny_model_dir, tmp_path):
    """Rank 0 SIGKILLed (no chance to clean up): its workers end too, none is left behind."""
    import subprocess
    import sys

    folder, _ = tiny_model_dir("llama")
    script = tmp_path / "rank0.py"
    script.write_text(
        "import sys\n"
        "from kvgate.engine import LLM\n"
        f"llm = LLM({str(folder)!r}, max_model_len=128, tensor_parallel_size=2)\n"
        "print(' '.join(str(p.pid) for p in llm.engine.runner.workers.procs), flush=True)\n"
        "sys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        line = proc.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 1, line
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 10
        alive = pids
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if Path(f"/proc/{p}").exists()
                     and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
            time.sleep(0.05)
        assert not alive, f"workers {alive} outlived rank 0"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.cuda
@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_cuda_tp2_with_graphs_matches_tp1(family, tiny_model_dir):
    """NCCL between two GPUs, the all-reduces captured in the CUDA graphs (the default: Triton kernels, graphs on):
    float32 greedy outputs token-identical to one GPU's."""
    folder, _ = tiny_model_dir(family)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in make_prompts()]
    single = LLM(str(folder), device="cuda", dtype="float32", max_model_len=128)
    try:
        expected = [o.outputs[0].token_ids for o in single.generate(prompts, params)]
    finally:
        single.engine.close()
    del single
    llm = LLM(str(folder), device="cuda", dtype="float32", max_model_len=128, tensor_parallel_size=2)
    try:
        assert llm.engine.runner.shapes is not None and llm.engine.runner.shapes.graphs, "no CUDA graphs captured"
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert got == expected
    finally:
        llm.engine.close()


@pytest.mark.processes
@pytest.mark.slow
def test_size_that_does_not_divide_the_heads_fails_the_start(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    started = time.monotonic()
    with pytest.raises(ModelLoadError, match="num_attention_heads \\(4\\) is not divisible by tensor_parallel_size 3"):
        LLM(str(folder), max_model_len=128, tensor_parallel_size=3)
    assert time.monotonic() - started < 60


def test_a_model_on_the_transformers_fallback_is_refused_before_any_rank_starts(tiny_model_dir):
    folder, _ = tiny_model_dir("phi3")  # the fallback's HF modules hold whole weights: nothing would be sharded
    with pytest.raises(ConfigError, match="Phi3ForCausalLM runs on the transformers fallback, which is not sharded"):
        LLM(str(folder), max_model_len=128, tensor_parallel_size=2)


@pytest.mark.processes
@pytest.mark.slow
def test_ngram_speculation_at_tp2_matches_hf(tiny_model_dir):
    """Verification steps (a decode's token and its drafts, batched by the workers from the broadcast flags)."""
    from tests.engine.test_spec_decode import SPEC, check_speculative_greedy, repetitive_prompts

    folder, hf = tiny_model_dir("qwen2")
    llm = LLM(str(folder), max_model_len=128, tensor_parallel_size=2, speculative_config=SPEC)
    try:
        check_speculative_greedy(llm, hf_greedy(hf, repetitive_prompts(), MAX_NEW), "qwen2", "tp2")
    finally:
        llm.engine.close()


@pytest.mark.processes
@pytest.mark.slow
def test_print_config_sizes_rank_0(capsys, tiny_model_dir):
    """`--print-config -tp 2` (CPU): the weights and KV blocks of rank 0, as a real TP=2 start has them."""
    import re

    from kvgate.cli import main

    folder, _ = tiny_model_dir("llama")
    capsys.readouterr()
    assert main(["serve", str(folder), "--print-config", "--device", "cpu", "-tp", "2", "--max-model-len", "128"]) == 0
    rows = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    llm = LLM(str(folder), device="cpu", max_model_len=128, tensor_parallel_size=2)
    try:
        runner = llm.engine.runner
        assert rows["kv_cache_blocks"].split()[0] == str(runner.num_blocks)
        assert int(re.search(r"\((\d+) bytes", rows["weights"]).group(1)) == sum(
            p.numel() * p.element_size() for p in runner.model.parameters())
    finally:
        llm.engine.close()
