"""Engine flags shared by `kvgate generate`, `kvgate serve` and `kvgate bench engine`: vLLM's flag names, which must
not drift (docs/architecture.md)."""

from __future__ import annotations

import argparse

from kvgate.common.sizes import parse_bytes
from kvgate.engine.config import KV_CACHE_DTYPES, EngineConfig
from kvgate.engine.generation_defaults import parse_override


def _utilization(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 < value <= 1.0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}")
    return value


def _lora_module(text: str):
    from kvgate.common.errors import ConfigError
    from kvgate.engine.lora.request import LoRAModulePath

    try:
        return LoRAModulePath.parse(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine flags, in --help's order: the engine group, LoRA adapters, the sim backend."""
    g = parser.add_argument_group("engine")
    _add_model_flags(g)
    _add_batching_flags(g)
    _add_kv_cache_flags(g)
    _add_execution_flags(g)
    _add_serving_flags(g)
    _add_speculative_flags(g)
    _add_generation_flags(g)
    _add_lora_args(parser)
    _add_sim_args(parser)


def _add_model_flags(g) -> None:
    """Engine flags: the model's backend, device and dtype."""
    g.add_argument("--backend", choices=["torch", "sim"], default="torch",
                   help="torch: run the model; sim: a timing model, no weights (default: torch)")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    g.add_argument("--dtype", default="auto",
                   help="auto, float32, bfloat16 or float16 (default auto: the checkpoint's on GPU, bfloat16 for "
                        "float32 checkpoints, float16 below compute capability 8.0; on CPU bfloat16 with "
                        "AVX512-BF16/AMX for hidden sizes >= 512, else float32)")
    g.add_argument("--quantization", "-q", choices=["fp8", "compressed-tensors", "gptq", "awq"], default=None,
                   help="the checkpoint's weight quantization, checked against its config.json quantization_config "
                        "(vLLM's flag; default: read from config.json). On CPU quantized linears are dequantized "
                        "into --dtype at load")


def _add_batching_flags(g) -> None:
    """Engine flags: the KV block, what one step and one request may hold, and torch's CPU threads."""
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="most requests in one batch (default: 128, or the KV cache's blocks when fewer)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step (default: 2048)")
    g.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="a prompt computes at most this many tokens a step, so requests behind a long uncached "
                        "prompt get their first tokens between its chunks instead of after it (0: up to the step's "
                        "budget; default: 0, vLLM's)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the model's, lowered to what the KV cache holds)")
    g.add_argument("--cpu-threads", type=int, default=None,
                   help="torch's CPU threads (default: OMP_NUM_THREADS when set, else the CPUs this process may "
                        "use: its affinity and cgroup quota, not the node's cores)")


def _add_kv_cache_flags(g) -> None:
    """Engine flags: the KV cache's memory and value type."""
    g.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", type=parse_bytes, default=None,
                   help="bytes for the KV cache, e.g. 2147483648 or 2GiB (suffixes are binary: 2G = 2GiB); "
                        "--gpu-memory-utilization is then not used (vLLM: --kv-cache-memory-bytes; default: "
                        "measured on GPU, 1 GiB on CPU)")
    g.add_argument("--gpu-memory-utilization", type=_utilization, default=EngineConfig.gpu_memory_utilization,
                   help="the share of the GPU's memory this engine may use in all: weights, activations and the KV "
                        "cache, which gets what is left; per engine, so two engines at 0.45 share a GPU; where other "
                        "processes leave less free, the cache gets what is free (logged) (vLLM's flag; not used with "
                        "--kv-cache-memory, nor on CPU; default: %(default)s)")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="KV cache values: auto (the model's dtype) or one byte each with a float32 scale per token "
                        "and KV head, about twice the tokens of bf16 in the same memory (fp8 = fp8_e4m3; "
                        "default: auto)")


def _add_execution_flags(g) -> None:
    """Engine flags: how steps run: CUDA graphs, async scheduling, the attention kernels."""
    g.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: every step launches its kernels one by one (default: graphs on CUDA)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule the next step while the GPU runs this one, so host work overlaps device work "
                        "(default: on for CUDA, off on CPU and the sim backend)")
    g.add_argument("--max-cudagraph-capture-size", type=int, default=None,
                   help="largest step (tokens) of mixed prefill+decode captured as a CUDA graph; larger steps run "
                        "eagerly; 0 captures decode steps only (default: 1024)")
    g.add_argument("--max-decode-splits", type=int, default=32,
                   help="split-KV decode (Triton path): the most splits a sequence's context takes in a decode step "
                        "of a small batch, in [1, 256]; 1 turns splitting off (default: 32)")
    g.add_argument("--attention-backend", choices=["auto", "sdpa", "triton"], default="auto",
                   help="paged attention: triton kernels reading block tables (default on CUDA) or SDPA over "
                        "gathered blocks (default on CPU)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="shard the model over this many ranks (one process each; on CUDA one GPU each, NCCL), "
                        "as vLLM's flag (default: 1)")


def _add_serving_flags(g) -> None:
    """Engine flags: the served name, prefix caching, scheduling, the seed and KV-cache events."""
    g.add_argument("--served-model-name", default=None, help="model name clients use (default: MODEL)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse KV blocks of shared prompt prefixes (default: on)")
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs")
    g.add_argument("--seed", type=int, default=0, help="engine random seed (default: 0)")
    g.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="publish KV-cache events as vLLM does, for cache-aware routers (llm-d, Dynamo), e.g. "
                        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
                        '"replay_endpoint": "tcp://*:5558", "topic": "kv-events"}\'; vLLM\'s keys (buffer_steps, '
                        "hwm, max_queue_size too). tcp://*:PORT listens on all interfaces; tcp://HOST:PORT connects "
                        "to a collector (default: off)")


def _add_speculative_flags(g) -> None:
    """Engine flags: speculative decoding."""
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding, vLLM's flag: '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": K, \"prompt_lookup_min\": a, \"prompt_lookup_max\": b}' drafts "
                        "up to K tokens that followed the last a..b-gram earlier in the request (lookup defaults: 5); "
                        "'{\"method\": \"draft_model\", \"model\": PATH, \"num_speculative_tokens\": K}' has a "
                        "smaller model of the same tokenizer draft K tokens; drafts are verified in one forward pass "
                        "(default: off)")
    g.add_argument("--speculative-backoff-threshold", type=float, metavar="ACCEPTED",
                   default=EngineConfig.speculative_backoff_threshold,
                   help="adaptive drafting (kvgate's own; vLLM drafts every step): a request whose moving average "
                        "of drafts accepted per drafted step falls below this pauses drafting, 1, 2, 4 .. 32 steps "
                        "while probes fail; 0 drafts every step (default: %(default)s; docs/engine.md)")


def _add_generation_flags(g) -> None:
    """Engine flags: sampling defaults."""
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                   help="sampling defaults for requests that leave temperature, top_p, top_k, min_p, "
                        "repetition_penalty or max_tokens out: auto, the model folder's generation_config.json (its "
                        "max_new_tokens bounds requests without max_tokens); vllm, none; or a folder's "
                        "generation_config.json, whose max_new_tokens then bounds every request (vLLM's flag; "
                        "default: auto)")
    g.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help="those defaults overridden, e.g. '{\"temperature\": 0.5, \"max_new_tokens\": 512}'; a "
                        "max_new_tokens here bounds every request (vLLM's flag)")


def _add_lora_args(parser: argparse.ArgumentParser) -> None:
    """The LoRA adapters group."""
    lora = parser.add_argument_group("LoRA adapters (vLLM's flags)")
    lora.add_argument("--enable-lora", action="store_true",
                      help="serve PEFT LoRA adapters over the base model, each as a model name (default: off)")
    lora.add_argument("--lora-modules", nargs="+", default=[], type=_lora_module, metavar="NAME=PATH",
                      help='adapters served from the start: name=path, or JSON {"name": .., "path": .., '
                           '"base_model_name": ..}; PATH is a PEFT folder (adapter_config.json + '
                           "adapter_model.safetensors)")
    lora.add_argument("--max-loras", type=int, default=1,
                      help="adapters one batch can mix (slots on the device; default: 1)")
    lora.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank served (default: 16)")
    lora.add_argument("--max-cpu-loras", type=int, default=None,
                      help="adapters kept loaded in host memory (default: --max-loras)")


def _add_sim_args(parser: argparse.ArgumentParser) -> None:
    """The sim backend's group: its timing model, and fault injection for chaos tests."""
    sim = parser.add_argument_group("sim backend (defaults resemble an 8B model on one H100)")
    sim.add_argument("--sim-profile", default=None, help="YAML/JSON file with SimProfile fields")
    sim.add_argument("--sim-step-overhead-ms", type=float, default=None)
    sim.add_argument("--sim-prefill-ms-per-token", type=float, default=None)
    sim.add_argument("--sim-decode-ms-per-seq", type=float, default=None)
    sim.add_argument("--sim-ms-per-context-token", type=float, default=None)
    sim.add_argument("--sim-slowdown", type=float, default=None, help="multiply every cost (a slow replica)")
    sim.add_argument("--sim-max-model-len", type=int, default=None)
    sim.add_argument("--sim-fail-after-steps", type=int, default=None,
                     help="fault injection for chaos tests: the engine loop dies of an exception at this step "
                          "(default 0: never)")
    sim.add_argument("--sim-hang-after-steps", type=int, default=None,
                     help="fault injection for chaos tests: the engine loop hangs for good at this step, as in a "
                          "deadlocked kernel, for `kvgate serve --engine-step-timeout` to catch (default 0: never)")


def engine_config_from_args(model_path: str, args: argparse.Namespace) -> EngineConfig:
    kv_events_config = None
    if getattr(args, "kv_events_config", None) is not None:
        from kvgate.engine.kv_events import KVEventsConfig

        kv_events_config = KVEventsConfig.from_json(args.kv_events_config)
    speculative_config = None
    if getattr(args, "speculative_config", None) is not None:
        from kvgate.engine.spec_decode import SpeculativeConfig

        speculative_config = SpeculativeConfig.from_json(args.speculative_config)
    sim_profile = None
    if args.backend == "sim":
        from kvgate.engine.sim_runner import SimProfile

        sim_profile = SimProfile.load(
            args.sim_profile, step_overhead_ms=args.sim_step_overhead_ms,
            prefill_ms_per_token=args.sim_prefill_ms_per_token, decode_ms_per_seq=args.sim_decode_ms_per_seq,
            ms_per_context_token=args.sim_ms_per_context_token, slowdown=args.sim_slowdown,
            max_model_len=args.sim_max_model_len, fail_after_steps=args.sim_fail_after_steps,
            hang_after_steps=args.sim_hang_after_steps)
    return EngineConfig(
        model=model_path,
        backend=args.backend,
        sim_profile=sim_profile,
        served_model_name=args.served_model_name,
        device=args.device,
        dtype=args.dtype,
        quantization=getattr(args, "quantization", None),
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=getattr(args, "gpu_memory_utilization", EngineConfig.gpu_memory_utilization),
        kv_cache_dtype=args.kv_cache_dtype,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        max_cudagraph_capture_size=args.max_cudagraph_capture_size,
        max_decode_splits=getattr(args, "max_decode_splits", EngineConfig.max_decode_splits),
        attention_backend=args.attention_backend,
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        enable_prefix_caching=args.enable_prefix_caching,
        scheduling_policy=args.scheduling_policy,
        seed=args.seed,
        cpu_threads=getattr(args, "cpu_threads", None),
        kv_events_config=kv_events_config,
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        lora_modules=tuple(args.lora_modules),
        speculative_config=speculative_config,
        speculative_backoff_threshold=getattr(args, "speculative_backoff_threshold",
                                              EngineConfig.speculative_backoff_threshold),
        generation_config=getattr(args, "generation_config", "auto"),
        override_generation_config=parse_override(getattr(args, "override_generation_config", None)),
    )
