"""`kvgate bench engine --sampling`: the sampling each request of the workload asks for.

greedy: temperature 0, no penalties, no logprobs (the argmax path; the bench's default).
realistic: what chat traffic sends: temperature 0.7, top-p 0.9, top-k 50, repetition penalty 1.05 on every request,
and one request in LOGPROBS_EVERY (12.5%) also asks for the top LOGPROBS logprobs of each token. No request sets a
seed: seeded requests are rare in real traffic, and the outputs of a sampled run are not compared token by token.
"""

from __future__ import annotations

SAMPLING_MIXES = ("greedy", "realistic")
REALISTIC = {"temperature": 0.7, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.05}
LOGPROBS_EVERY = 8  # every 8th request (index 0, 8, 16, ...) asks for logprobs
LOGPROBS = 5


def sampling_params_for(mix: str, num_requests: int, output_len: int) -> list:
    """One SamplingParams per request: exactly output_len tokens each (ignore_eos), sampled as `mix` says."""
    from kvgate.engine import SamplingParams

    if mix == "greedy":
        return [SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)] * num_requests
    if mix != "realistic":
        raise ValueError(f"unknown sampling mix {mix!r} ({', '.join(SAMPLING_MIXES)})")
    return [SamplingParams(**REALISTIC, max_tokens=output_len, ignore_eos=True,
                           logprobs=LOGPROBS if i % LOGPROBS_EVERY == 0 else None) for i in range(num_requests)]


def describe_mix(mix: str, params: list) -> dict:
    """The mix as the result file records it: its name, the settings, and how many requests each kind has."""
    with_logprobs = sum(p.logprobs is not None for p in params)
    greedy = sum(p.temperature == 0.0 for p in params)
    return {"mix": mix, "requests": len(params), "greedy_requests": greedy, "sampled_requests": len(params) - greedy,
            "logprobs_requests": with_logprobs, "logprobs_share": with_logprobs / max(1, len(params)),
            "logprobs_top": LOGPROBS if with_logprobs else None,
            "settings": dict(REALISTIC) if mix == "realistic" else {"temperature": 0.0}}


def hf_generate_kwargs(mix: str) -> dict:
    """HF generate's arguments for the same sampling (its baseline samples as kvgate does; HF computes no
    logprobs here, so its logprob requests cost it nothing extra)."""
    if mix == "greedy":
        return {"do_sample": False}
    return {"do_sample": True, **REALISTIC}
