"""Each engine's command line from a ModelServer's spec.engine fields: `kvgate serve`, `vllm serve`, SGLang.

spec.engine.type picks the engine (kvgate, the default; vllm; sglang). The fields mean the same for all three and
are spelled as each engine's own flags:

  field                  kvgate serve / vllm serve          python3 -m sglang.launch_server
  device                 --device / (none: the image's      --device cpu|cuda (auto: none)
                         build; cpu: no GPUs requested)
  model.path             positional MODEL                   --model-path
  servedModelName        --served-model-name                --served-model-name
  tensorParallelSize     --tensor-parallel-size             --tp-size
  maxModelLen            --max-model-len                    --context-length
  blockSize              --block-size                       --page-size
  enablePrefixCaching    --[no-]enable-prefix-caching       --disable-radix-cache when false
  maxNumSeqs             --max-num-seqs                     --max-running-requests
  maxNumBatchedTokens    --max-num-batched-tokens           --chunked-prefill-size (tokens a prefill chunk)
  gpuMemoryUtilization   --gpu-memory-utilization           --mem-fraction-static (weights and KV pool)
  kvCacheMemory          --kv-cache-memory / vLLM's         (none: refused)
                         --kv-cache-memory-bytes
  kvCacheDtype           --kv-cache-dtype                   --kv-cache-dtype (fp8 is fp8_e4m3; no int8)
  quantization, dtype    --quantization, --dtype            --quantization, --dtype
  kvEvents               --kv-events-config JSON            --kv-events-config JSON (no enable key)
  lora                   --enable-lora --lora-modules       --enable-lora --lora-paths name=path
                         --max-loras --max-lora-rank        --max-loras-per-batch --max-lora-rank
                         --max-cpu-loras                    --max-loaded-loras
  shutdownGrace...       --shutdown-timeout                 (none; only the pod's termination grace)

vLLM's names are those of its `vllm serve` parser (vllm/engine/arg_utils.py, entrypoints/launchers/cli_args.py,
0.32); SGLang's those of ServerArgs (python/sglang/srt/server_args.py). A field one engine has no flag for (the
kvgate engine's `backend: sim`, `device: cuda:N` for vLLM, prompt lookup for SGLang) is a problem naming the
field and the engine (`engine_problems`), never silently dropped.
"""

from __future__ import annotations

import json
import re

KVGATE, VLLM, SGLANG = "kvgate", "vllm", "sglang"
ENGINE_TYPES = (KVGATE, VLLM, SGLANG)
DEFAULT_MODEL = "demo"
ADAPTERS_DIR = "/adapters"  # where spec.engine.lora.source is mounted (read-only)
DEFAULT_SHUTDOWN_GRACE_S = 30  # the engine's --shutdown-timeout unless spec.engine says otherwise
QUANTIZATIONS = ("fp8", "compressed-tensors", "gptq", "awq")  # what all three engines' --quantization take
SGLANG_KV_CACHE_DTYPES = {"auto": "auto", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
VLLM_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's int8 is per-token-head, another layout

# Flags the operator sets itself, per engine; extraArgs may not set them again (argparse's last one would win).
OPERATOR_FLAGS = {KVGATE: ("--host", "--port", "--shutdown-timeout"),
                  VLLM: ("--host", "--port", "--shutdown-timeout"),
                  SGLANG: ("--host", "--port", "--model-path", "--model")}
# Flags with a spec field that the pod's shape depends on (GPUs requested, /dev/shm): set through the field only.
SPEC_FLAGS = {KVGATE: {"--tensor-parallel-size": "engine.tensorParallelSize",
                       "--quantization": "engine.quantization"},
              VLLM: {"--tensor-parallel-size": "engine.tensorParallelSize", "--quantization": "engine.quantization"},
              SGLANG: {"--tp-size": "engine.tensorParallelSize", "--tensor-parallel-size": "engine.tensorParallelSize",
                       "--quantization": "engine.quantization"}}

_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti)?$")


def engine_type(spec: dict) -> str:
    """spec.engine.type; kvgate when unset."""
    return (spec.get("engine") or {}).get("type") or KVGATE


def kv_cache_bytes(quantity: int | str) -> int:
    """`kvCacheMemory` (bytes, or a binary-suffixed quantity such as "2Gi") as bytes."""
    if isinstance(quantity, int):
        return quantity
    m = _QUANTITY.match(str(quantity).strip())
    if not m:
        raise ValueError(f"not a byte quantity: {quantity!r} (e.g. 2147483648 or 2Gi)")
    power = ["", "Ki", "Mi", "Gi", "Ti"].index(m.group(2) or "")
    return int(float(m.group(1)) * 1024 ** power)


def shutdown_grace_s(spec: dict) -> int:
    value = (spec.get("engine") or {}).get("shutdownGracePeriodSeconds")
    return DEFAULT_SHUTDOWN_GRACE_S if value is None else int(value)


# --- what each engine cannot take ---------------------------------------------------------------------------

def engine_problems(spec: dict) -> list[str]:
    """Fields `spec.engine.type`'s engine has no flag or setting for, each naming the field and the engine."""
    engine = spec.get("engine") or {}
    kind = engine_type(spec)
    if kind not in ENGINE_TYPES:
        return [f"type {str(kind)[:40]!r} is not one of {', '.join(ENGINE_TYPES)}"]
    if kind == KVGATE:
        return []
    problems = []
    if engine.get("backend") is not None:
        problems.append(f"backend is the kvgate engine's own (torch or sim); {kind} has no such setting")
    device = engine.get("device")
    if kind == VLLM and device not in (None, "auto", "cpu"):
        problems.append(f"device {device!r}: vLLM runs on the platform its build (the image) is for; leave device "
                        "unset with a GPU image (cpu: a CPU image, no GPUs requested)")
    if kind == SGLANG and device is not None and device not in ("auto", "cpu", "cuda"):
        problems.append(f"device {device!r}: SGLang takes a device kind (cpu or cuda), not one GPU")
    dtype = engine.get("kvCacheDtype")
    if kind == VLLM and dtype is not None and dtype not in VLLM_KV_CACHE_DTYPES:
        problems.append(f"kvCacheDtype {dtype!r}: vLLM's --kv-cache-dtype takes {', '.join(VLLM_KV_CACHE_DTYPES)} "
                        "of this field's values (its int8 caches are another layout)")
    if kind == SGLANG and dtype is not None and dtype not in SGLANG_KV_CACHE_DTYPES:
        problems.append(f"kvCacheDtype {dtype!r}: SGLang's --kv-cache-dtype takes "
                        f"{', '.join(SGLANG_KV_CACHE_DTYPES)} of this field's values")
    if kind == SGLANG:
        if engine.get("kvCacheMemory") is not None:
            problems.append("kvCacheMemory: SGLang sizes its KV pool by gpuMemoryUtilization (--mem-fraction-static) "
                            "or in tokens (--max-total-tokens in extraArgs), not in bytes")
        if engine.get("speculativeConfig"):
            problems.append("speculativeConfig: prompt lookup (ngram) is a kvgate and vLLM method; give SGLang's "
                            "--speculative-algorithm flags in extraArgs")
        if engine.get("apiKeySecretRef"):
            problems.append("apiKeySecretRef: SGLang reads its key only from --api-key, so the key would be in the "
                            "pod spec and in every process listing of the node; it has no environment variable "
                            "for it (use vllm or kvgate, or authenticate at the Gateway)")
    return [f"engine: {p}" for p in problems]


# --- the command lines ---------------------------------------------------------------------------------------

def serve_command(spec: dict, port: int, traces_endpoint: str | None = None) -> list[str]:
    """The engine container's command for spec.engine.type, extraArgs last. `traces_endpoint` (the operator's
    --otlp-traces-endpoint): vLLM traces only with its --otlp-traces-endpoint flag, so it gets the flag; the kvgate
    engine and SGLang read the pod's OTEL_* variables (modelserver.engine_env)."""
    render = {KVGATE: kvgate_command, VLLM: vllm_command, SGLANG: sglang_command}[engine_type(spec)]
    tracing = ["--otlp-traces-endpoint", traces_endpoint] if traces_endpoint and engine_type(spec) == VLLM else []
    return render(spec, port) + tracing + [str(a) for a in spec.get("extraArgs") or []]


def _model(spec: dict) -> tuple[str, str]:
    model = spec.get("model") or {}
    path = model.get("path") or DEFAULT_MODEL
    return path, model.get("servedModelName") or path


def _valued(engine: dict, pairs: tuple[tuple[str, str], ...]) -> list[str]:
    flags = []
    for field, flag in pairs:
        if engine.get(field) is not None:
            flags += [flag, str(engine[field])]
    return flags


def kvgate_command(spec: dict, port: int) -> list[str]:
    path, served = _model(spec)
    return (["kvgate", "serve", path, "--host", "0.0.0.0", "--port", str(port), "--served-model-name", served]
            + engine_flags(spec.get("engine") or {}) + ["--shutdown-timeout", str(shutdown_grace_s(spec))])


def vllm_command(spec: dict, port: int) -> list[str]:
    """`vllm serve`: the kvgate engine speaks vLLM's flags, less its own (backend, device, --require-api-key) and
    with vLLM's name for the KV cache's size."""
    path, served = _model(spec)
    engine = {k: v for k, v in (spec.get("engine") or {}).items()
              if k not in ("backend", "device", "kvCacheMemory", "apiKeySecretRef")}
    flags = engine_flags(engine)
    if (spec.get("engine") or {}).get("kvCacheMemory") is not None:
        flags += ["--kv-cache-memory-bytes", str(kv_cache_bytes(spec["engine"]["kvCacheMemory"]))]
    return (["vllm", "serve", path, "--host", "0.0.0.0", "--port", str(port), "--served-model-name", served]
            + flags + ["--shutdown-timeout", str(shutdown_grace_s(spec))])


def sglang_command(spec: dict, port: int) -> list[str]:
    path, served = _model(spec)
    engine = spec.get("engine") or {}
    device = [] if engine.get("device") in (None, "auto") else ["--device", engine["device"]]  # auto: SGLang's own
    flags = device + _valued(engine, (("dtype", "--dtype"), ("blockSize", "--page-size"),
                                      ("maxNumSeqs", "--max-running-requests"),
                                      ("maxNumBatchedTokens", "--chunked-prefill-size"),
                                      ("maxModelLen", "--context-length")))
    if engine.get("gpuMemoryUtilization") is not None:
        flags += ["--mem-fraction-static", repr(float(engine["gpuMemoryUtilization"]))]
    if engine.get("kvCacheDtype") is not None:
        flags += ["--kv-cache-dtype", SGLANG_KV_CACHE_DTYPES[engine["kvCacheDtype"]]]
    if engine.get("quantization") is not None:
        flags += ["--quantization", engine["quantization"]]
    if engine.get("tensorParallelSize") is not None:
        flags += ["--tp-size", str(int(engine["tensorParallelSize"]))]
    if engine.get("enablePrefixCaching") is False:
        flags.append("--disable-radix-cache")
    if engine.get("kvEvents"):
        config = {k: v for k, v in kv_events_config(engine["kvEvents"]).items() if k != "enable_kv_cache_events"}
        flags += ["--kv-events-config", json.dumps(config, separators=(",", ":"))]
    if engine.get("lora"):
        flags += sglang_lora_flags(engine["lora"])
    return (["python3", "-m", "sglang.launch_server", "--model-path", path, "--host", "0.0.0.0", "--port", str(port),
             "--served-model-name", served, "--enable-metrics"] + flags)


def engine_flags(engine: dict) -> list[str]:
    """`spec.engine` as `kvgate serve` (vLLM-style) flags, in a fixed order; unset fields keep the engine's
    defaults."""
    flags = _valued(engine, (("backend", "--backend"), ("device", "--device"), ("dtype", "--dtype"),
                             ("blockSize", "--block-size"), ("maxNumSeqs", "--max-num-seqs"),
                             ("maxNumBatchedTokens", "--max-num-batched-tokens"), ("maxModelLen", "--max-model-len")))
    if engine.get("kvCacheMemory") is not None:
        flags += ["--kv-cache-memory", str(kv_cache_bytes(engine["kvCacheMemory"]))]
    if engine.get("gpuMemoryUtilization") is not None:
        flags += ["--gpu-memory-utilization", repr(float(engine["gpuMemoryUtilization"]))]
    if engine.get("kvCacheDtype") is not None:
        flags += ["--kv-cache-dtype", engine["kvCacheDtype"]]
    if engine.get("quantization") is not None:
        flags += ["--quantization", engine["quantization"]]
    if engine.get("tensorParallelSize") is not None:
        flags += ["--tensor-parallel-size", str(int(engine["tensorParallelSize"]))]
    if engine.get("speculativeConfig"):
        flags += ["--speculative-config", json.dumps(speculative_config(engine["speculativeConfig"]),
                                                      separators=(",", ":"))]
    if engine.get("enablePrefixCaching") is not None:
        flags.append("--enable-prefix-caching" if engine["enablePrefixCaching"] else "--no-enable-prefix-caching")
    if engine.get("kvEvents"):
        flags += ["--kv-events-config", json.dumps(kv_events_config(engine["kvEvents"]), separators=(",", ":"))]
    if engine.get("lora"):
        flags += lora_flags(engine["lora"])
    if engine.get("apiKeySecretRef"):
        # The key itself comes in the environment (VLLM_API_KEY); this makes an empty Secret value a failed start
        # rather than an engine that serves without a key.
        flags.append("--require-api-key")
    return flags


def speculative_config(spec: dict) -> dict:
    """spec.engine.speculativeConfig as vLLM's --speculative-config JSON (prompt lookup; unset keys keep the engine's
    defaults)."""
    config = {"method": spec.get("method") or "ngram", "num_speculative_tokens": spec["numSpeculativeTokens"]}
    for field, key in (("promptLookupMin", "prompt_lookup_min"), ("promptLookupMax", "prompt_lookup_max")):
        if spec.get(field) is not None:
            config[key] = spec[field]
    return config


def kv_events_config(kv_events: dict) -> dict:
    """spec.engine.kvEvents as vLLM's --kv-events-config JSON: bind every interface of the pod (the EPP connects
    from its own pod) on the given ports. The events carry prompts' token ids and cache salts: the pool's
    `<pool>-engines` NetworkPolicy (network_policy.py) admits only its EPP to these ports. The publisher's byte
    and replay limits keep the engine's defaults (engine/kv_events.py)."""
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{int(kv_events['port'])}"}
    if kv_events.get("replayPort"):
        config["replay_endpoint"] = f"tcp://*:{int(kv_events['replayPort'])}"
    return config


def _adapter_paths(lora: dict) -> list[str]:
    return [f"{a['name']}={ADAPTERS_DIR}/{a['path'].strip('/')}" for a in lora["adapters"]]


def lora_flags(lora: dict) -> list[str]:
    """spec.engine.lora as vLLM's flags, each adapter a --lora-modules name=/adapters/<path>."""
    flags = ["--enable-lora"] + _valued(lora, (("maxLoras", "--max-loras"), ("maxLoraRank", "--max-lora-rank"),
                                               ("maxCpuLoras", "--max-cpu-loras")))
    return flags + ["--lora-modules", *_adapter_paths(lora)]


def sglang_lora_flags(lora: dict) -> list[str]:
    """spec.engine.lora as SGLang's flags, each adapter a --lora-paths name=/adapters/<path>."""
    flags = ["--enable-lora"] + _valued(lora, (("maxLoras", "--max-loras-per-batch"),
                                               ("maxLoraRank", "--max-lora-rank"),
                                               ("maxCpuLoras", "--max-loaded-loras")))
    return flags + ["--lora-paths", *_adapter_paths(lora)]
