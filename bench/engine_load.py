"""`kvgate bench load`: how long loading a checkpoint takes and how much memory it needs, for the engine's loader
(engine/loader.py: memory-mapped safetensors copied straight into the parameters), the loader it replaced (kept
here as the reference: `safe_open` + `get_tensor(name).to(dtype)`, a full copy per tensor) and HF transformers'
`AutoModelForCausalLM.from_pretrained`, on the same random checkpoint built here (no download), unsharded and
sharded.

Each load runs in a fresh subprocess, imports done before the clock starts. Two times: `load`, the load call, and
`ready`, until every weight page has also been read once, as a first forward pass reads them all (transformers,
on the CPU in the checkpoint's dtype, returns weights that are still lazily mapped pages of the file). Memory:
the child's peak RSS (VmHWM, reset just before the load) above its RSS before the load, and the RSS growth at
ready split into anonymous memory and mapped file pages. (Not `ru_maxrss`: across fork + exec Linux carries the
parent's peak into the child's, so a child of this 1 GB process would report at least that.)

Loaders run in turn, the order reversed every other round; the tables show medians. The checkpoint's files are in
the page cache (just written, or read by the round before): warm-cache numbers. `1st ready` is each loader's
first load (cold only if `--checkpoint-dir` reused files not read since the machine started). Every load's weights
are checked to be the checkpoint's (a digest of five tensors, the parameter count, the dtype), and the RSS must
show the weights' bytes once they are read (check_sane); the command fails otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

# Qwen2-0.5B's shapes (494M parameters, tied embeddings, qkv bias); "tiny" is the test suite's.
SIZES = {
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                 rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "tiny": dict(vocab_size=1024, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                 rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
}
LOADERS = ("transformers", "baseline", "mmap")
LAYOUTS = ("unsharded", "sharded")
SPEC_FILE = "kvgate-bench-load.json"


def add_bench_load_parser(sub) -> None:
    p = sub.add_parser("load", help="checkpoint load time and peak RSS: kvgate's mmap loader vs the old one vs HF")
    p.add_argument("--size", choices=list(SIZES), default="0.5b",
                   help="the random checkpoint: 0.5b (Qwen2-0.5B's shapes, default) or tiny")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                   help="the checkpoint's dtype, and the dtype every loader loads into (default bfloat16)")
    p.add_argument("--shards", type=int, default=6,
                   help="the sharded layout's max shard size is the checkpoint's size over this (default 6; a "
                        "tensor larger than that, the embedding, is a shard of its own)")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="unsharded, sharded or both (default)")
    p.add_argument("--loaders", default=",".join(LOADERS), help="any of " + ", ".join(LOADERS) + " (default all)")
    p.add_argument("--mmap-workers", default="1",
                   help="copy threads of the mmap loader; a list (1,2,4) runs it once per value (mmap_wN)")
    p.add_argument("--rounds", type=int, default=3, help="loads of each (loader, layout); medians are shown")
    p.add_argument("--max-model-len", type=int, default=4096,
                   help="positions our model's RoPE tables are built for (the engine's max_model_len)")
    p.add_argument("--device", default="cpu", help="where the weights go: cpu (default) or cuda")
    p.add_argument("--checkpoint-dir", default=None,
                   help="build (or reuse, when it holds the same spec) the checkpoints here instead of a temp folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-file", default=None, help="also write the results as JSON here")
    p.set_defaults(func=run_bench_load)


# -- the reference: the loader engine/loader.py replaced ------------------------------------------------------------

def reference_iterate_weights(model_path: str | Path, dtype) -> Iterator[tuple[str, object]]:
    """The engine's loader before the mmap one, kept as this benchmark's baseline: safetensors' `get_tensor` makes
    a full copy of each tensor (and `.to(dtype)` a second one when the dtype differs) before load_weights copies
    it into the parameter."""
    from safetensors import safe_open

    from kvgate.engine.loader import safetensors_files

    for file in safetensors_files(model_path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name).to(dtype)


# -- the checkpoint -------------------------------------------------------------------------------------------------

def _hf_config(size: str, dtype: str):
    from transformers import Qwen2Config

    return Qwen2Config(**SIZES[size], architectures=["Qwen2ForCausalLM"], dtype=dtype)


def build_checkpoints(root: Path, size: str, dtype: str, shards: int, seed: int) -> dict:
    """root/unsharded and root/sharded: the same random weights (normal, std 0.02; norms 1), as one file and as
    shards with an index, like save_pretrained(max_shard_size=...). Reused when root holds the same spec."""
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    spec = {"size": size, "dtype": dtype, "shards": shards, "seed": seed, "version": 1}
    spec_file = root / SPEC_FILE
    if spec_file.is_file():
        saved = json.loads(spec_file.read_text())
        if saved.get("spec") == spec:
            return saved
    config = _hf_config(size, dtype)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    gen = torch.Generator().manual_seed(seed)
    state = {}
    torch_dtype = getattr(torch, dtype)
    for name, shape in shapes.items():
        t = torch.empty(shape, dtype=torch_dtype)
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        else:
            t.normal_(0.0, 0.02, generator=gen)
        state[name] = t
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    for layout in LAYOUTS:
        folder = root / layout
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("*.safetensors*"):
            old.unlink()
        config.save_pretrained(str(folder))
    save_file(state, str(root / "unsharded" / "model.safetensors"), metadata={"format": "pt"})
    split = split_torch_state_dict_into_shards(state, max_shard_size=max(1, nbytes // shards))
    for filename, names in split.filename_to_tensors.items():
        save_file({n: state[n] for n in names}, str(root / "sharded" / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_size": nbytes}, "weight_map": split.tensor_to_filename}
        (root / "sharded" / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    saved = {"spec": spec, "parameters": sum(t.numel() for t in state.values()), "bytes": nbytes,
             "shard_files": len(split.filename_to_tensors)}
    spec_file.write_text(json.dumps(saved))
    return saved


# -- one load, in a child process -----------------------------------------------------------------------------------

def _status_kib() -> dict[str, int]:
    """VmRSS, VmHWM (the peak), RssAnon and RssFile of this process, in KiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(line.split()[1])
    return out


def _reset_peak_rss() -> bool:
    """Set this process's peak RSS (VmHWM) back to its current RSS (Linux's clear_refs 5), so the peak read after
    the load is the load's own, not that of the imports before it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _touch(model) -> None:
    """Read a byte of every 4 KiB page of every parameter, as a first forward pass reads them all: weights a loader
    left in a lazily read mapping of the file (transformers does, on the CPU in the checkpoint's dtype) are read
    from the file here."""
    import torch

    for p in model.parameters():
        flat = p.detach().reshape(-1).view(torch.uint8)
        flat[::4096].sum().item()


def _digest(model, hf_layout: bool) -> str:
    """sha256 over five tensors whose bytes both model layouts hold: the embedding, layer 0's q and k rows (ours
    are rows of the fused qkv_proj), the last layer's down_proj and the final norm."""
    import hashlib

    import torch

    params = dict(model.named_parameters())
    n = model.config.num_hidden_layers
    if hf_layout:
        q, k = params["model.layers.0.self_attn.q_proj.weight"], params["model.layers.0.self_attn.k_proj.weight"]
    else:
        attn = model.model.layers[0].self_attn
        qkv = params["model.layers.0.self_attn.qkv_proj.weight"]
        q, k = qkv[:attn.q_size], qkv[attn.q_size:attn.q_size + attn.kv_size]
    h = hashlib.sha256()
    for t in (params["model.embed_tokens.weight"], q, k, params[f"model.layers.{n - 1}.mlp.down_proj.weight"],
              params["model.norm.weight"]):
        h.update(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def child_load(loader: str, folder: str, dtype_name: str, device_name: str, max_model_len: int,
               workers: int) -> dict:
    """One load, timed, in this (fresh) process; returns its numbers."""
    import resource

    import torch

    from kvgate.engine.loader import load_hf_config

    dtype, device = getattr(torch, dtype_name), torch.device(device_name)
    hf_config = load_hf_config(folder)
    max_model_len = min(max_model_len, hf_config.max_position_embeddings)
    if loader == "transformers":
        import transformers

        getattr(transformers, hf_config.architectures[0])  # the modeling module imported before the clock starts
    else:
        import importlib

        from kvgate.engine.cpu_allocator import keep_large_allocations_in_heap
        from kvgate.engine.loader import load_model

        importlib.import_module("kvgate.engine.models")  # load_model's import, before the clock like HF's
        if device.type == "cpu":
            keep_large_allocations_in_heap()  # as the engine's runner does before it loads
    reset = _reset_peak_rss()
    before = _status_kib()
    t0 = time.perf_counter()
    if loader == "transformers":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True,
                                                     device_map=None if device.type == "cpu" else device_name)
    elif loader == "baseline":
        model = load_model(hf_config, folder, device, dtype, max_model_len,
                           weights=reference_iterate_weights(folder, dtype))
    else:
        model = load_model(hf_config, folder, device, dtype, max_model_len, workers=workers)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    load_s = time.perf_counter() - t0
    loaded = _status_kib()
    _touch(model)
    ready_s = time.perf_counter() - t0
    ready = _status_kib()
    params = list(model.parameters())
    return {"load_s": load_s, "ready_s": ready_s, "peak_reset": reset, "rss_before_kib": before["VmRSS"],
            "load_peak_kib": loaded["VmHWM"] - before["VmRSS"], "ready_peak_kib": ready["VmHWM"] - before["VmRSS"],
            "ready_anon_kib": ready["RssAnon"] - before["RssAnon"],
            "ready_file_kib": ready["RssFile"] - before["RssFile"],
            # not used: across fork + exec Linux carries the parent's peak into it (VmHWM is this process's own)
            "ru_maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            "parameters": sum(p.numel() for p in params),
            "dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in params}),
            "digest": _digest(model, loader == "transformers")}


def _run_child(loader: str, folder: Path, args, workers: int) -> dict:
    cmd = [sys.executable, "-m", "kvgate.bench.engine_load", loader, str(folder), args.dtype, args.device,
           str(args.max_model_len), str(workers)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"kvgate bench load: the {loader} load of {folder} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# -- the benchmark --------------------------------------------------------------------------------------------------

def _names(text: str, known, what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise SystemExit(f"kvgate bench load: unknown {what}: {', '.join(bad) or '(none)'}; known: {', '.join(known)}")
    return names


def check_sane(runs: list[dict], checkpoint: dict, dtype: str) -> list[str]:
    """What is wrong with the measurements (empty: nothing). Every load must hold the checkpoint's weights (the
    same digest everywhere, every parameter, in the asked dtype), in positive time, ready no sooner than loaded;
    on the CPU, once every page was read, the weights' bytes must show in the RSS growth (anonymous or file-backed),
    or the memory numbers measure something else."""
    problems = []
    digests = {r["digest"] for r in runs}
    if len(digests) != 1:
        problems.append(f"the loads hold different weights ({len(digests)} distinct digests)")
    for r in runs:
        what = f"{r['label']} ({r['layout']}, round {r['round'] + 1})"
        if r["parameters"] != checkpoint["parameters"]:
            problems.append(f"{what} loaded {r['parameters']} parameters, the checkpoint has "
                            f"{checkpoint['parameters']}")
        if r["dtypes"] != [dtype]:
            problems.append(f"{what} loaded {r['dtypes']}, not {dtype}")
        if not 0 < r["load_s"] <= r["ready_s"] < 3600:
            problems.append(f"{what}: load {r['load_s']} s, ready {r['ready_s']} s")
        if not 0 <= r["load_peak_kib"] <= r["ready_peak_kib"]:
            problems.append(f"{what}: load peak {r['load_peak_kib']} KiB, ready peak {r['ready_peak_kib']} KiB")
        grown = (r["ready_anon_kib"] + r["ready_file_kib"]) * 1024
        if r["device"] == "cpu" and min(grown, r["ready_peak_kib"] * 1024) < 0.95 * checkpoint["bytes"]:
            problems.append(f"{what}: the RSS grew by {grown / 2**20:.1f} MiB (peak {r['ready_peak_kib'] / 1024:.1f} "
                            f"MiB), less than the {checkpoint['bytes'] / 2**20:.1f} MiB of weights it holds")
    return problems


def summarize(runs: list[dict], layouts: list[str], labels: list[str]) -> dict:
    """layout -> label -> medians over the rounds, the first round's times, and ratios against transformers and
    the baseline (load time, ready time, ready peak)."""
    summary: dict = {}
    for layout in layouts:
        rows = summary.setdefault(layout, {})
        for label in labels:
            mine = [r for r in runs if r["layout"] == layout and r["label"] == label]
            if not mine:
                continue
            first = min(mine, key=lambda r: r["round"])

            def median(key, mine=mine):
                return statistics.median(r[key] for r in mine)

            rows[label] = {
                "load_s": median("load_s"), "ready_s": median("ready_s"),
                "ready_s_min": min(r["ready_s"] for r in mine), "ready_s_max": max(r["ready_s"] for r in mine),
                "first_round_load_s": first["load_s"], "first_round_ready_s": first["ready_s"],
                "load_peak_mib": median("load_peak_kib") / 1024, "ready_peak_mib": median("ready_peak_kib") / 1024,
                "ready_anon_mib": median("ready_anon_kib") / 1024, "ready_file_mib": median("ready_file_kib") / 1024,
                "rounds": len(mine),
            }
        for ref in ("transformers", "baseline"):
            if ref not in rows:
                continue
            for row in rows.values():
                for key in ("load_s", "ready_s", "ready_peak_mib"):
                    row[f"{key}_vs_{ref}"] = row[key] / rows[ref][key]
    return summary


def print_table(summary: dict) -> None:
    def ratios(r, key):
        return ", ".join(f"{r[f'{key}_vs_{ref}']:.2f}x" if f"{key}_vs_{ref}" in r else "-"
                         for ref in ("transformers", "baseline"))

    print(f"\n{'layout':<10}{'loader':<14}{'load (s)':>9}{'ready (s)':>10}{'1st ready':>10}"
          f"{'load / transformers, baseline':>32}{'ready / transformers, baseline':>33}")
    for layout, rows in summary.items():
        for label, r in rows.items():
            print(f"{layout:<10}{label:<14}{r['load_s']:>9.2f}{r['ready_s']:>10.2f}"
                  f"{r['first_round_ready_s']:>10.2f}{ratios(r, 'load_s'):>32}{ratios(r, 'ready_s'):>33}")
    print(f"\n{'layout':<10}{'loader':<14}{'load peak':>10}{'ready peak':>11}{'anon':>7}{'file':>7}"
          f"{'ready peak / transformers, baseline':>38}   (MiB, above the RSS before the load)")
    for layout, rows in summary.items():
        for label, r in rows.items():
            print(f"{layout:<10}{label:<14}{r['load_peak_mib']:>10.0f}{r['ready_peak_mib']:>11.0f}"
                  f"{r['ready_anon_mib']:>7.0f}{r['ready_file_mib']:>7.0f}{ratios(r, 'ready_peak_mib'):>38}")
    print("load: the load call; ready: until every weight page was also read once (a first forward pass); peaks: "
          "the process's peak RSS during each, less its RSS before the load; anon / file: the RSS growth at ready, "
          "anonymous memory and pages of the mapped checkpoint (shared, reclaimable page cache)")


def run_bench_load(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    layouts = _names(args.layouts, LAYOUTS, "layouts")
    loaders = _names(args.loaders, LOADERS, "loaders")
    try:
        workers = [int(w) for w in args.mmap_workers.split(",") if w.strip()]
    except ValueError:
        raise SystemExit(f"kvgate bench load: --mmap-workers takes integers, got {args.mmap_workers!r}") from None
    if not workers or min(workers) < 1 or args.rounds < 1 or args.shards < 1:
        raise SystemExit("kvgate bench load: --mmap-workers, --rounds and --shards must be positive")
    # (label, loader, workers): one mmap row per worker count, "mmap" when there is one
    variants = [(name, name, 1) for name in loaders if name != "mmap"]
    if "mmap" in loaders:
        variants += [("mmap" if len(workers) == 1 else f"mmap_w{w}", "mmap", w) for w in workers]

    tmp = None
    if args.checkpoint_dir:
        root = Path(args.checkpoint_dir)
        root.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="kvgate-bench-load-")
        root = Path(tmp.name)
    t0 = time.perf_counter()
    print(f"building the random {args.size} checkpoint ({args.dtype}) in {root} ...", flush=True)
    checkpoint = build_checkpoints(root, args.size, args.dtype, args.shards, args.seed)
    print(f"checkpoint: {checkpoint['parameters'] / 1e6:.1f}M parameters, {checkpoint['bytes'] / 2**20:.0f} MiB; "
          f"sharded into {checkpoint['shard_files']} files ({time.perf_counter() - t0:.1f} s)", flush=True)

    runs = []
    plan = []
    for rnd in range(args.rounds):
        order = variants if rnd % 2 == 0 else variants[::-1]
        plan += [(rnd, layout, v) for layout in (layouts if rnd % 2 == 0 else layouts[::-1]) for v in order]
    with tqdm(total=len(plan), unit="load", file=sys.stderr, leave=False) as bar:
        for rnd, layout, (label, loader, w) in plan:
            bar.set_description(f"round {rnd + 1} {layout} {label}")
            r = _run_child(loader, root / layout, args, w)
            r.update(round=rnd, layout=layout, label=label, loader=loader, workers=w, device=args.device)
            runs.append(r)
            bar.update(1)
    summary = summarize(runs, layouts, [v[0] for v in variants])
    print(f"device {args.device}, dtype {args.dtype}, {args.rounds} rounds (medians), page cache warm (the files "
          f"were just written or read; `1st ready` is each one's first load), our RoPE tables for "
          f"{args.max_model_len} positions")
    print_table(summary)
    if not all(r["peak_reset"] for r in runs):
        print("(this kernel refused to reset the peak RSS: the peaks include the imports before the load)")
    problems = check_sane(runs, checkpoint, args.dtype)
    for p in problems:
        print(f"kvgate bench load: not sane: {p}", file=sys.stderr)
    if not problems:
        print(f"every load holds the checkpoint's weights (digest {runs[0]['digest'][:12]}, "
              f"{checkpoint['parameters']} parameters)")
    if args.result_file:
        Path(args.result_file).write_text(json.dumps({
            "size": args.size, "dtype": args.dtype, "device": args.device, "rounds": args.rounds,
            "max_model_len": args.max_model_len, "page_cache": "warm", "checkpoint": checkpoint,
            "summary": summary, "runs": runs, "problems": problems}, indent=2))
    if tmp is not None:
        tmp.cleanup()
    return 1 if problems else 0


if __name__ == "__main__":  # the child of _run_child: loader folder dtype device max_model_len workers
    loader_, folder_, dtype_, device_, max_len_, workers_ = sys.argv[1:7]
    print(json.dumps(child_load(loader_, folder_, dtype_, device_, int(max_len_), int(workers_))))
