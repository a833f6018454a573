"""Where a decode step's time goes on a GPU (run by tests/engine/gpu_check.sh's `profile` stage; not a test).

1. The attention kernel alone on the bench's decode shape (qwen3-0.5b: 16 heads, 8 KV heads, head_dim 128, 256
   sequences of 37-640 tokens, bf16), for several launch settings, as bandwidth against the device's copy rate.
2. The engine at a full decode batch: the host stages of a step (schedule, launch, update, the rest) apart from its
   wait for the device, and the device kernels by time (torch.profiler), over a few steps.
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path

import torch


def attention_sweep(bandwidth: float) -> None:
    import triton.testing

    from kvgate.engine import triton_attention as ta
    from tests.engine.paged_reference import random_paged_batch

    rng = random.Random(0)
    seqs = [(rng.randint(37, 640), 1) for _ in range(256)]
    q, cache, table, lens, starts = random_paged_batch(seqs, 16, 8, 128, 16, torch.bfloat16, "cuda")
    context = sum(c + 1 for c, _ in seqs)
    nbytes = context * 8 * 128 * 2 * 2 + q.numel() * 4
    out = torch.empty_like(q)
    print(f"decode attention, 256 seqs, {context} context tokens: {nbytes / 1e6:.0f} MB a layer")
    for tile in (32, 64, 128):
        for warps in (2, 4, 8):
            for stages in (1, 2, 3):
                try:
                    fn = lambda: ta.paged_attention(q, cache, out, table, lens, starts, scale=0.088, block_size=16,  # noqa: E731
                                                    decode_only=True, tile=tile, num_warps=warps, num_stages=stages)
                    ms = triton.testing.do_bench(fn, warmup=20, rep=100, return_mode="median")
                    print(f"  tile {tile:>3} warps {warps} stages {stages}: {ms * 1e3:7.1f} us, "
                          f"{nbytes / ms / 1e9:6.0f} GB/s ({100 * nbytes / ms * 1e3 / bandwidth:4.1f}% of copy)")
                except Exception as exc:  # noqa: BLE001 - a setting that does not fit is reported, not fatal
                    print(f"  tile {tile} warps {warps} stages {stages}: {type(exc).__name__} {exc}"[:200])


def engine_profile(model: str = "qwen3-0.5b", device: str = "cuda") -> None:
    """model: a random model the bench builds, or "demo" (how this is checked on a CPU)."""
    from torch.profiler import ProfilerActivity, profile

    from kvgate.engine import LLM, SamplingParams
    from kvgate.bench.engine import _build_random_model

    if model == "demo":
        folder = "demo"
    else:
        folder = Path(tempfile.mkdtemp(prefix="kvgate-profile-"))
        _build_random_model(model, folder, torch.bfloat16)
    llm = LLM(str(folder), device=device, max_num_seqs=256, max_num_batched_tokens=8192)
    engine = llm.engine
    rng = random.Random(0)
    for i in range(256):
        engine.add_request(f"r{i}", [rng.randrange(256) for _ in range(rng.randint(37, 510))],
                           SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    for _ in range(12):  # the prefills, then decodes only
        engine.step(final_only=True)
    stages = {"schedule": 0.0, "launch": 0.0, "wait": 0.0, "update": 0.0, "rest": 0.0}
    sched, run, upd = engine.scheduler.schedule, engine.runner.launch, engine.scheduler.update_from_output

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            r = fn(*a, **k)
            stages[name] += time.perf_counter() - t0
            return r
        return wrapper

    def launch(*a, **k):
        step = timed("launch", run)(*a, **k)
        step.result = timed("wait", step.result)  # the wait for its sampled ids (the device's time shows here)
        return step

    engine.scheduler.schedule = timed("schedule", sched)
    engine.runner.launch = launch
    engine.scheduler.update_from_output = timed("update", upd)
    n = 30
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        engine.step(final_only=True)  # as LLM.generate and the bench step
    total = time.perf_counter() - t0
    stages["rest"] = total - sum(v for k, v in stages.items() if k != "rest")
    print(f"full decode batch (async scheduling {'on' if engine.async_scheduling else 'off'}): "
          f"{1e3 * total / n:.2f} ms a step; host work {1e3 * (total - stages['wait']) / n:.2f} ms (" +
          ", ".join(f"{k} {1e3 * v / n:.2f} ms" for k, v in stages.items() if k != "wait") +
          f"), waiting for the device {1e3 * stages['wait'] / n:.2f} ms")
    engine.scheduler.schedule, engine.runner.launch, engine.scheduler.update_from_output = sched, run, upd
    if device != "cuda":
        return
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            engine.step(final_only=True)
        sync()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))


if __name__ == "__main__":
    from kvgate.bench.engine_roofline import copy_bandwidth

    bw = copy_bandwidth(torch.device("cuda"))
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    if "attention" in sys.argv[1:] or len(sys.argv) == 1:
        attention_sweep(bw)
    if "engine" in sys.argv[1:] or len(sys.argv) == 1:
        engine_profile()
