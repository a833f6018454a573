"""`kvgate bench engine --baselines vllm`: the bench's workload through vLLM's offline `LLM.generate`, in a child
process of another interpreter (one with vLLM installed; kvgate does not depend on vLLM). The child runs
vllm_generate.py, which reads the workload as JSON on stdin and writes its outputs and time as JSON on stdout."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from kvgate.common.errors import ConfigError

SCRIPT = Path(__file__).with_name("vllm_generate.py")
PYTHON_ENV = "KVGATE_VLLM_PYTHON"  # the default of --vllm-python
KVCACHE_GIB = 4  # vLLM's CPU KV cache unless $VLLM_CPU_KVCACHE_SPACE says otherwise: the bench's workloads need less


def vllm_python(args) -> str:
    """The interpreter --vllm-python (or $KVGATE_VLLM_PYTHON) names; a ConfigError (one line, exit 2) if none is
    given or it is not an executable file."""
    python = args.vllm_python or os.environ.get(PYTHON_ENV)
    if not python:
        raise ConfigError(f"--baselines vllm needs an interpreter with vLLM installed: --vllm-python PATH "
                          f"(or ${PYTHON_ENV})")
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise ConfigError(f"--vllm-python {python}: not an executable file")
    return python


def vllm_request(model_path: str, dtype: str, prompts: list[list[int]], output_len: int) -> dict:
    """The JSON object vllm_generate.py reads: the model folder, the dtype's name ("float32"), the prompts as token
    ids, the output length; the context is the longest prompt and its output."""
    return {"model": str(model_path), "dtype": dtype, "prompts": [list(map(int, p)) for p in prompts],
            "output_len": int(output_len), "max_model_len": max(map(len, prompts)) + int(output_len)}


def run_vllm(python: str, request: dict, timeout: float | None = None) -> dict:
    """vllm_generate.py under `python` on `request`: its result ({"seconds", "outputs", "vllm_version"}). vLLM's
    log (the child's stderr) is kept and its tail given in the ConfigError raised when the child fails."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    # vLLM's CPU build otherwise sizes its KV cache to nearly all the host's memory; the environment's own
    # VLLM_CPU_KVCACHE_SPACE (GiB), like its thread settings (VLLM_CPU_OMP_THREADS_BIND), passes through.
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(KVCACHE_GIB))
    proc = subprocess.run([python, str(SCRIPT)], input=json.dumps(request), capture_output=True, text=True,
                          env=env, timeout=timeout)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-20:])
        raise ConfigError(f"vLLM ({python} {SCRIPT.name}) exited with {proc.returncode}:\n{tail}")
    result = json.loads(proc.stdout)
    if len(result["outputs"]) != len(request["prompts"]):
        raise ConfigError(f"vLLM returned {len(result['outputs'])} outputs for {len(request['prompts'])} prompts")
    return result
