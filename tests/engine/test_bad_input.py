"""Bad input gets a clear error naming the problem, and requests already in the engine are unaffected."""

import json
import shutil

import pytest

from kvgate.engine import LLM, ConfigError, InvalidRequestError, ModelLoadError, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    return LLM(str(folder), max_model_len=64)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: SamplingParams(temperature=-0.5), "temperature"),
        (lambda: SamplingParams(top_p=0.0), "top_p"),
        (lambda: SamplingParams(top_p=1.5), "top_p"),
        (lambda: SamplingParams(max_tokens=0), "max_tokens"),
        (lambda: SamplingParams(top_k=-3), "top_k"),
        (lambda: SamplingParams(min_p=2.0), "min_p"),
        (lambda: SamplingParams(n=0), "n"),
        (lambda: SamplingParams(logprobs=100), "logprobs"),
        (lambda: SamplingParams(max_tokens=2, min_tokens=5), "min_tokens"),
    ],
)
def test_bad_sampling_params(make, match):
    with pytest.raises(ValueError, match=match) as info:
        make()
    assert isinstance(info.value, InvalidRequestError)


def test_bad_requests_leave_running_ones_untouched(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params)[0].outputs[0].token_ids

    engine.add_request("good", [5, 6, 7], params)
    engine.step()  # the good request is mid-flight
    with pytest.raises(InvalidRequestError, match="context length is 64"):
        engine.add_request("too-long", list(range(70)), params)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.add_request("bad-token", [1, 99999], params)
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("empty", [], params)
    bad = SamplingParams(temperature=0.0, max_tokens=8)
    bad.temperature = -1.0  # mutated after construction: the engine validates again
    with pytest.raises(InvalidRequestError, match="temperature"):
        engine.add_request("bad-params", [1, 2], bad)
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("good", [1, 2], params)

    outputs = []
    for _ in range(50):
        if not engine.has_unfinished_requests():
            break
        outputs.extend(engine.step())
    final = [o for o in outputs if o.finished]
    assert [o.request_id for o in final] == ["good"]
    assert final[0].outputs[0].token_ids == expected
    assert engine.stats().kv_cache_usage == 0.0


def test_a_bad_prompt_in_a_batch_rejects_the_call_cleanly(llm):
    params = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(InvalidRequestError, match="context length"):
        llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": list(range(100))}], params)
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate([{"prompt_token_ids": [1, 2]}], params)[0].outputs[0].finish_reason in ("length", "stop")


def test_unknown_architecture(tiny_model_dir, tmp_path):
    folder, _ = tiny_model_dir("llama")
    shutil.copytree(folder, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["architectures"] = ["FooBarForCausalLM"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="FooBarForCausalLM"):
        LLM(str(tmp_path / "m"))


def test_model_folder_without_weights(tiny_model_dir, tmp_path):
    folder, _ = tiny_model_dir("llama")
    shutil.copytree(folder, tmp_path / "m", ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(ModelLoadError, match="no .safetensors weights"):
        LLM(str(tmp_path / "m"))


def test_missing_folder_and_bad_engine_args(tiny_model_dir, tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "nowhere"))
    folder, _ = tiny_model_dir("llama")
    with pytest.raises(ConfigError, match="max_model_len"):
        LLM(str(folder), max_model_len=10_000)
    with pytest.raises(ConfigError, match="fewer than max_model_len"):
        LLM(str(folder), max_model_len=256, num_gpu_blocks_override=4)
    with pytest.raises(ConfigError, match="block_size"):
        LLM(str(folder), block_size=12)


def test_out_of_range_seed_is_refused_before_anything_is_registered(llm):
    engine = llm.engine
    params = SamplingParams(n=2, seed=0, max_tokens=4)
    params.seed = 2**64 - 1  # torch takes it for the first child, not for seed + 1 of the second
    with pytest.raises(InvalidRequestError, match="seed"):
        engine.add_request("seeded", [1, 2, 3], params)
    # before: the request was registered and its first child kept generating for nobody
    assert not engine.has_unfinished_requests()
    with pytest.raises(InvalidRequestError, match="seed"):
        SamplingParams(seed=2**63)
    assert SamplingParams(n=3, seed=2**63 - 3).seed == 2**63 - 3


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                                   "frequency_penalty"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_sampling_numbers_are_refused(field, value):
    # NaN passed every range check before (all comparisons are false) and reached the sampler
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**{field: value})


def test_ids_and_top_k_past_the_vocabulary_cannot_break_a_step(llm):
    engine = llm.engine
    with pytest.raises(InvalidRequestError, match="stop token id"):
        engine.add_request("stop-ids", [1, 2], SamplingParams(stop_token_ids=[10**12], min_tokens=2, max_tokens=4))
    assert not engine.has_unfinished_requests()
    # a top_k too large for a tensor keeps every token, like top_k off
    out = llm.generate([{"prompt_token_ids": [1, 2]}], SamplingParams(top_k=10**30, max_tokens=3, seed=1))
    assert len(out[0].outputs[0].token_ids) == 3
