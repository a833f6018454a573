"""The vLLM side of `kvgate bench engine --baselines vllm`: run by path with an interpreter that has vLLM installed
(never imported by kvgate, which does not depend on vLLM; this file imports nothing of kvgate).

Reads one JSON object on stdin:
    {"model": folder, "dtype": "float32", "prompts": [[token id, ...], ...], "output_len": int,
     "max_model_len": int}
runs the prompts through vLLM's offline `LLM.generate` (greedy, exactly output_len tokens each: ignore_eos, no
detokenizing, no tokenizer loaded) after a short warm-up and a prefix-cache reset, and writes one JSON object on
stdout:
    {"seconds": float, "outputs": [[token id, ...], ...], "vllm_version": str}
vLLM's own logging goes to stderr (stdout is pointed at stderr while vLLM runs), so stdout carries the result alone.
"""

from __future__ import annotations

import json
import os
import sys
import time

REQUEST_KEYS = {"model": str, "dtype": str, "prompts": list, "output_len": int, "max_model_len": int}


def read_request(text: str) -> dict:
    """The request JSON, checked: every key of REQUEST_KEYS of its type, prompts non-empty lists of ints."""
    request = json.loads(text)
    if not isinstance(request, dict):
        raise ValueError("the request is not a JSON object")
    for key, kind in REQUEST_KEYS.items():
        if not isinstance(request.get(key), kind):
            raise ValueError(f"request field {key!r} missing or not {kind.__name__}")
    prompts = request["prompts"]
    if not prompts or not all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts):
        raise ValueError("request field 'prompts' must be a non-empty list of non-empty lists of token ids")
    return request


def generate(request: dict) -> dict:
    """The timed run through vLLM (imported here: only this interpreter has it)."""
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=request["model"], dtype=request["dtype"], max_model_len=request["max_model_len"],
              skip_tokenizer_init=True, seed=0)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in request["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=request["output_len"], ignore_eos=True, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=request["prompts"][0][:16])],
                 SamplingParams(temperature=0.0, max_tokens=4, detokenize=False), use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return {"seconds": elapsed, "outputs": [list(o.outputs[0].token_ids) for o in outs],
            "vllm_version": vllm.__version__}


def main() -> int:
    request = read_request(sys.stdin.read())
    sys.stdout.flush()
    result_fd = os.dup(1)
    os.dup2(2, 1)  # vLLM and its workers print to stdout: send that to stderr, keep the real stdout for the result
    result = generate(request)
    with os.fdopen(result_fd, "w") as out:
        json.dump(result, out)
        out.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
