"""`kvgate bench structured-outputs`: what structured outputs cost. Decode tokens/s of one batch in which half the
requests are constrained by a JSON schema, against the same batch with none constrained, as a ratio.

Both runs sample at temperature 1.0 with the same prompts and produce exactly `--output-len` tokens per request
(ignore_eos for the free half; the constrained half's schema asks for an array of at least 10000 objects, which
no request completes, so every step computes a real JSON mask: keys, strings, numbers). The first runs warm up.

`--compare-libraries` instead measures what chose the grammar library (engine/structured_output.py): mask fill +
token advance per token, walking one valid JSON document through llguidance and, when it is installed, xgrammar,
on the demo's byte-level tokenizer and on a 32k BPE trained here from transformers' own source files.
"""

from __future__ import annotations

import argparse
import time

# An object array no request can finish within --output-len: a mask per step, every step.
ENDLESS_SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "minItems": 10000, "items": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                       "name": {"type": "string", "maxLength": 8},
                       "kind": {"enum": ["a", "bb", "ccc"]}},
        "required": ["id", "name", "kind"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False,
}


def add_bench_structured_parser(sub) -> None:
    from kvgate.engine.cli_args import add_engine_args

    p = sub.add_parser("structured-outputs", help="decode tokens/s with half the batch schema-constrained vs none")
    p.add_argument("--model", default="demo", help="'demo' (default) or a local HF folder")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each batch; the best is kept")
    p.add_argument("--compare-libraries", action="store_true",
                   help="measure llguidance (and xgrammar, if installed) per-token mask cost instead")
    add_engine_args(p)
    p.set_defaults(func=run_bench_structured)


def run_bench_structured(args: argparse.Namespace) -> int:
    if args.compare_libraries:
        return compare_libraries(args.repeats)
    from kvgate.engine import LLM, SamplingParams
    from kvgate.bench.engine import make_workload
    from kvgate.engine.cli_args import engine_config_from_args
    from kvgate.engine.llm import resolve_model_path
    from kvgate.engine.sampling_params import StructuredOutputsParams

    llm = LLM.from_config(engine_config_from_args(resolve_model_path(args.model), args))
    engine = llm.engine
    prompts = [{"prompt_token_ids": p} for p in make_workload(args.num_requests, args.prompt_len, args.prompt_len,
                                                              engine.vocab_size, 0)]
    free = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True)
    constrained = SamplingParams(temperature=1.0, max_tokens=args.output_len,
                                 structured_outputs=StructuredOutputsParams(json=ENDLESS_SCHEMA))
    half = args.num_requests // 2
    batches = {"none constrained": [free] * args.num_requests,
               "half constrained": [constrained] * half + [free] * (args.num_requests - half)}

    def output_rate(batch, params, repeats) -> float:
        """Output tokens/s of the whole run (short prompts: decode dominates; prefill is the same in both)."""
        best = 0.0
        for _ in range(repeats):
            engine.reset_prefix_cache()
            t0 = time.perf_counter()
            outs = llm.generate(batch, params)
            elapsed = time.perf_counter() - t0
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            assert tokens == len(batch) * args.output_len, "a request ended early: the rates would not compare"
            best = max(best, tokens / elapsed)
        return best

    output_rate(prompts[:2], [constrained, free], 1)  # warm-up: the grammar's tokenizer view, the mask thread
    rates = {name: output_rate(prompts, params, args.repeats) for name, params in batches.items()}
    base = rates["none constrained"]
    print(f"model {args.model} | backend {args.backend} | device {engine.device} | {args.num_requests} requests x "
          f"{args.output_len} tokens (prompts {args.prompt_len}), temperature 1.0, best of {args.repeats}")
    print(f"{'batch':<22}{'output tok/s':>14}{'vs none':>10}")
    for name, rate in rates.items():
        print(f"{name:<22}{rate:>14.1f}{rate / base:>9.2f}x")
    return 0


# One valid document of a 5-field nested schema, walked token by token by each library.
LIBRARY_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 5},
        "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "score": {"type": "number"}},
    "required": ["name", "age", "tags", "address", "score"], "additionalProperties": False,
}
LIBRARY_DOCUMENT = ('{"name":"Ada Lovelace the first programmer","age":36,"tags":["a","ccc","bb"],'
                    '"address":{"city":"London town","zip":"12345"},"score":-12.5e3}')


def _bpe_32k():
    """A 32000-token byte-level BPE trained on transformers' model sources (local files, ~10 s)."""
    from pathlib import Path

    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(str(f) for f in (Path(transformers.__file__).parent / "models").rglob("*.py"))[:1500]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(files, trainers.BpeTrainer(vocab_size=32000, special_tokens=["<s>", "</s>"], show_progress=False,
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def _time_llguidance(tokenizer, ids: list[int], repeats: int) -> tuple[float, float, float]:
    import llguidance
    import llguidance.hf
    import torch

    t0 = time.perf_counter()
    ll_tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
    init = time.perf_counter() - t0
    grammar = llguidance.LLMatcher.grammar_from_json_schema(LIBRARY_SCHEMA)
    t0 = time.perf_counter()
    llguidance.LLMatcher(ll_tok, grammar)
    compile_s = time.perf_counter() - t0
    row = torch.zeros((len(tokenizer) + 31) // 32, dtype=torch.int32)
    best = float("inf")
    for _ in range(repeats):
        matcher = llguidance.LLMatcher(ll_tok, grammar)
        t0 = time.perf_counter()
        for t in ids:
            matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
            assert matcher.consume_token(t), matcher.get_error()
        best = min(best, (time.perf_counter() - t0) / len(ids))
    return init, compile_s, best


def _time_xgrammar(tokenizer, ids: list[int], repeats: int) -> tuple[float, float, float]:
    import json

    import xgrammar

    t0 = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    init = time.perf_counter() - t0
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(LIBRARY_SCHEMA))
    compile_s = time.perf_counter() - t0
    mask = xgrammar.allocate_token_bitmask(1, len(tokenizer))
    best = float("inf")
    for _ in range(repeats):
        matcher = xgrammar.GrammarMatcher(compiled)
        t0 = time.perf_counter()
        for t in ids:
            matcher.fill_next_token_bitmask(mask, 0)
            assert matcher.accept_token(t)
        best = min(best, (time.perf_counter() - t0) / len(ids))
    return init, compile_s, best


def compare_libraries(repeats: int) -> int:
    import importlib.util

    from transformers import PreTrainedTokenizerFast

    from kvgate.common.demo import ensure_byte_tokenizer

    libraries = {"llguidance": _time_llguidance}
    if importlib.util.find_spec("xgrammar") is not None:
        libraries["xgrammar"] = _time_xgrammar
    else:
        print("xgrammar is not installed: measuring llguidance only (pip install xgrammar to compare)")
    tokenizers = {"demo byte-level": lambda: PreTrainedTokenizerFast.from_pretrained(str(ensure_byte_tokenizer())),
                  "BPE trained here": _bpe_32k}
    print(f"{'tokenizer':<18}{'vocab':>7}{'tokens':>8}  {'library':<12}{'tokenizer init':>16}{'compile':>11}"
          f"{'mask+advance':>16}")
    for tok_name, make in tokenizers.items():
        tokenizer = make()
        ids = tokenizer.encode(LIBRARY_DOCUMENT, add_special_tokens=False)
        for lib, timer in libraries.items():
            init, compile_s, per_token = timer(tokenizer, ids, max(repeats, 1))
            print(f"{tok_name:<18}{len(tokenizer):>7}{len(ids):>8}  {lib:<12}{init * 1e3:>13.1f} ms"
                  f"{compile_s * 1e3:>8.1f} ms{per_token * 1e6:>11.1f} us/tok", flush=True)
    return 0
