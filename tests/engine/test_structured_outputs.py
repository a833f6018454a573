"""Structured outputs with the random demo model, the hardest case: left alone it emits garbage, so every
valid output below is the token masks' doing. 200 samples at temperature 1.0 per constraint, in one batch each.

Strings carry maxLength, numbers bounds (minimum/maximum, and multipleOf for decimals) and every object
additionalProperties: false: the random model, free inside a string, a number or an open object, rarely closes
it (it writes digits until max_tokens: `"count":1850505503948855555...`), and an output cut there cannot parse.
Binary-exact multipleOf steps (0.25, 0.5) keep jsonschema's float check exact.
"""

import json
import random
import re
import time

import jsonschema
import pytest

from kvgate.engine import LLM, SamplingParams
from kvgate.common.errors import InvalidRequestError
from kvgate.engine.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.slow

NUM_SAMPLES = 200
MAX_TOKENS = 400

SHORT = {"type": "string", "maxLength": 8}
SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": SHORT, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
             "required": ["name", "age"], "additionalProperties": False},
    "enums_and_numbers": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "active": {"type": "boolean"},
                       "ratio": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25},
                       "count": {"type": "integer", "minimum": -500, "maximum": 10000}},
        "required": ["color", "active", "ratio", "count"], "additionalProperties": False},
    "arrays": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": SHORT, "minItems": 1, "maxItems": 4},
                       "scores": {"type": "array", "maxItems": 3,
                                  "items": {"type": "number", "minimum": 0, "maximum": 100, "multipleOf": 0.5}}},
        "required": ["tags", "scores"], "additionalProperties": False},
    "nested": {
        "type": "object",
        "properties": {
            "user": {"type": "object", "properties": {
                "id": {"type": "integer", "minimum": 1, "maximum": 99999},
                "address": {"type": "object", "properties": {"city": SHORT,
                                                             "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                            "required": ["city", "zip"], "additionalProperties": False}},
                "required": ["id", "address"], "additionalProperties": False},
            "roles": {"type": "array", "items": {"enum": ["admin", "dev", "ops"]}, "maxItems": 3}},
        "required": ["user", "roles"], "additionalProperties": False},
    "required_and_optional": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[a-f0-9]{4}-[0-9]{2}$"},
            "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                "type": "object",
                "properties": {"sku": SHORT, "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                               "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000,
                                         "multipleOf": 0.25}},
                "required": ["sku", "qty"], "additionalProperties": False}},
            "note": {"anyOf": [SHORT, {"type": "null"}]},
            "priority": {"enum": [1, 2, 3]}},
        "required": ["id", "items"], "additionalProperties": False},
}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kvgate-cache")


@pytest.fixture(scope="module")
def llm(cache_dir):
    with pytest.MonkeyPatch.context() as mp:  # the demo model is built here, not in the user's cache
        mp.setenv("KVGATE_CACHE_DIR", str(cache_dir))
        return LLM("demo", max_model_len=1024, max_num_seqs=NUM_SAMPLES, max_num_batched_tokens=4096)


def prompts(n: int) -> list[str]:
    rng = random.Random(0)
    return ["".join(chr(rng.randrange(33, 127)) for _ in range(rng.randint(3, 20))) for _ in range(n)]


def sample(llm, constraint: StructuredOutputsParams | None, n: int = NUM_SAMPLES, max_tokens: int = MAX_TOKENS,
           **kw) -> list:
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, structured_outputs=constraint, **kw)
    return [o.outputs[0] for o in llm.generate(prompts(n), params)]


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_sample_validates_against_the_schema(llm, name):
    schema = SCHEMAS[name]
    started = time.monotonic()
    outs = sample(llm, StructuredOutputsParams(json=schema))
    for c in outs:
        assert c.finish_reason == "stop", (c.finish_reason, c.text)
        jsonschema.validate(json.loads(c.text), schema)
    assert len({c.text for c in outs}) > NUM_SAMPLES // 2  # really sampled, not one answer 200 times
    print(f"{name}: {NUM_SAMPLES} samples, mean {sum(len(c.token_ids) for c in outs) / len(outs):.0f} tokens, "
          f"{time.monotonic() - started:.1f} s")


def test_unconstrained_demo_output_is_not_json(llm):
    """The control: without a mask the same prompts give no parsable object (else the test above proves nothing)."""
    outs = sample(llm, None, n=50, max_tokens=64)
    parsed = 0
    for c in outs:
        try:
            json.loads(c.text)
            parsed += 1
        except ValueError:
            pass
    assert parsed == 0


def test_regex_and_choice(llm):
    pattern = r"[a-z]{2,5}-[0-9]{3}( [A-Z]{1,6})?"
    for c in sample(llm, StructuredOutputsParams(regex=pattern)):
        assert re.fullmatch(pattern, c.text), c.text
    choices = ["yes", "no", "maybe so", "n/a"]
    outs = sample(llm, StructuredOutputsParams(choice=choices))
    assert all(c.text in choices and c.finish_reason == "stop" for c in outs)
    assert len({c.text for c in outs}) > 1


def test_grammar_and_json_object(llm):
    gbnf = 'root ::= "(" num ("+" num){0,4} ")"\nnum ::= [0-9]{1,3}'
    for c in sample(llm, StructuredOutputsParams(grammar=gbnf), n=50):
        assert re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3}){0,4}\)", c.text), c.text
    lark = 'start: "<" word (" " word)? ">"\nword: /[a-z]{1,5}/'
    for c in sample(llm, StructuredOutputsParams(grammar=lark), n=50):
        assert re.fullmatch(r"<[a-z]{1,5}( [a-z]{1,5})?>", c.text), c.text
    for c in sample(llm, StructuredOutputsParams(json_object=True), n=50, max_tokens=100):
        assert c.finish_reason != "stop" or isinstance(json.loads(c.text), dict)


def test_constraint_longer_than_max_tokens_ends_with_length(llm):
    """A constraint that max_tokens cannot complete ends with finish_reason length, not a hang."""
    constraint = StructuredOutputsParams(regex="[0-9]{50}")
    outs = llm.generate(prompts(4), SamplingParams(max_tokens=20, structured_outputs=constraint))
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "length" and len(c.token_ids) == 20 and re.fullmatch("[0-9]{20}", c.text)
    # The model's own taste decides when "[0-9]+x" ends: max_tokens bounds it either way.
    for c in sample(llm, StructuredOutputsParams(regex="[0-9]+x"), n=8):
        assert len(c.token_ids) <= MAX_TOKENS and c.finish_reason in ("stop", "length")
        assert re.fullmatch("[0-9]+x" if c.finish_reason == "stop" else "[0-9]*", c.text), c.text


def test_mixed_batch_leaves_unconstrained_greedy_tokens_unchanged(llm):
    texts = prompts(8)
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(texts, greedy)]
    constrained = SamplingParams(temperature=1.0, max_tokens=64,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMAS["nested"]))
    mixed = llm.generate(texts + texts, [greedy] * len(texts) + [constrained] * len(texts))
    assert [o.outputs[0].token_ids for o in mixed[:len(texts)]] == alone
    assert all(o.outputs[0].text.startswith("{") for o in mixed[len(texts):])


@pytest.mark.parametrize("constraint, param", [
    (dict(json={"type": "object", "properties": 5}), "structured_outputs"),
    (dict(json={"type": "string", "minLength": 5, "maxLength": 2}), "structured_outputs"),
    (dict(regex="a(b"), "structured_outputs"),
    (dict(grammar="root ::= ("), "structured_outputs"),
])
def test_bad_constraints_are_refused_when_added(llm, constraint, param):
    with pytest.raises(InvalidRequestError) as err:
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(**constraint)))
    assert err.value.param == param


def test_constraint_needs_exactly_one_kind():
    with pytest.raises(InvalidRequestError):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(InvalidRequestError):
        StructuredOutputsParams()


def _tokenizer_of(chars: str):
    """A byte-level tokenizer that has only these characters (and EOS): a vocabulary that cannot spell everything."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from kvgate.common.demo import _byte_level_chars

    table = _byte_level_chars()
    tok = Tokenizer(models.BPE(vocab={table[ord(c)]: i for i, c in enumerate(chars)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")


def test_constraint_the_tokenizer_cannot_spell():
    import torch

    from kvgate.engine.structured_output import StructuredOutputManager, allowed_token_ids

    tok = _tokenizer_of("ab")
    eos = tok.eos_token_id
    manager = StructuredOutputManager(tok, len(tok), (eos,))
    # Not even a first token: refused when the request is added.
    with pytest.raises(InvalidRequestError, match="cannot be satisfied with this model's tokenizer") as err:
        manager.grammar_for(StructuredOutputsParams(regex="c", param="guided_regex"))
    assert err.value.param == "guided_regex" and len(str(err.value)) < 400
    # A dead end later: only EOS is let through, and the request ends saying why.
    grammar = manager.grammar_for(StructuredOutputsParams(regex="ac"))
    row = torch.zeros(manager.bitmask_width, dtype=torch.int32)
    grammar.fill_bitmask(row)
    assert allowed_token_ids(row, len(tok)) == [tok.convert_tokens_to_ids("a")]
    grammar.accept(tok.convert_tokens_to_ids("a"))
    grammar.fill_bitmask(row)
    assert allowed_token_ids(row, len(tok)) == [eos] and grammar.error


def test_sim_backend_honours_schemas(cache_dir, monkeypatch):
    monkeypatch.setenv("KVGATE_CACHE_DIR", str(cache_dir))
    sim = LLM("sim", backend="sim", max_model_len=1024, max_num_seqs=64)
    schema = SCHEMAS["nested"]
    outs = sim.generate(prompts(50), SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(
        json=schema)))
    for o in outs:
        jsonschema.validate(json.loads(o.outputs[0].text), schema)
    choices = ["alpha", "beta"]
    outs = sim.generate(prompts(20), SamplingParams(structured_outputs=StructuredOutputsParams(choice=choices)))
    assert {o.outputs[0].text for o in outs} == set(choices)


def test_masks_filled_beside_the_forward_pass_give_the_same_tokens(llm):
    """The accelerator path (masks in a thread during the forward pass), forced on CPU: same seeded outputs."""
    runner = llm.engine.runner
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=MAX_TOKENS,
                            structured_outputs=StructuredOutputsParams(json=SCHEMAS["flat"]))
    in_line = [o.outputs[0].token_ids for o in llm.generate(prompts(8), params)]
    runner.fill_masks_in_thread = True
    try:
        threaded = [o.outputs[0].token_ids for o in llm.generate(prompts(8), params)]
    finally:
        runner.fill_masks_in_thread = False
    assert threaded == in_line and runner._mask_pool is not None


@pytest.mark.processes
def test_bench_prints_the_ratio(llm, cache_dir):
    import os
    import subprocess
    import sys
    from pathlib import Path

    kvgate = str(Path(sys.executable).parent / "kvgate")
    env = dict(os.environ, KVGATE_CACHE_DIR=str(cache_dir))  # the demo model the llm fixture built
    out = subprocess.run([kvgate, "bench", "structured-outputs", "--num-requests", "4", "--output-len", "8",
                          "--repeats", "1", "--max-model-len", "256"], capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 0, out.stderr
    assert re.search(r"half constrained\s+[0-9.]+\s+[0-9.]+x", out.stdout), out.stdout


def test_preempted_constrained_requests_resume_their_grammar(cache_dir, monkeypatch):
    """A request recomputed after preemption keeps its matcher's state: its output still validates."""
    monkeypatch.setenv("KVGATE_CACHE_DIR", str(cache_dir))
    # The demo's K/V: 4 layers x 4 heads x 32 dims x 2 x 4 bytes = 4 KiB a token; 40 blocks of 16 tokens.
    small = LLM("demo", max_model_len=512, max_num_seqs=16, kv_cache_memory=40 * 16 * 4096)
    schema = SCHEMAS["required_and_optional"]
    outs = small.generate(prompts(16), SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS,
                                                      structured_outputs=StructuredOutputsParams(json=schema)))
    assert small.engine.scheduler.num_preemptions > 0
    for o in outs:
        assert o.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(o.outputs[0].text), schema)
