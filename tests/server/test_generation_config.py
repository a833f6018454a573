"""The model's sampling defaults (vLLM's --generation-config and --override-generation-config): a checkpoint's
generation_config.json fills what a request leaves out, through `kvgate serve` and the official openai client."""

from __future__ import annotations

import json
import logging
import subprocess

import openai
import pytest

from kvgate.common.demo import build_demo_model
from kvgate.common.errors import ConfigError
from kvgate.engine.generation_defaults import load_generation_defaults, parse_override
from tests.procs import KVGATE, KvgateServe

pytestmark = pytest.mark.processes

# The checkpoint recommends greedy decoding and at most 6 new tokens (do_sample and the token ids are not sampling
# defaults: vLLM takes neither).
RECOMMENDED = {"temperature": 0.0, "top_k": 50, "max_new_tokens": 6, "do_sample": False, "bos_token_id": 1}
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("demo-with-generation-config")
    build_demo_model(folder)
    (folder / "generation_config.json").write_text(json.dumps(RECOMMENDED))
    return folder


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def auto_server(model_dir, kvgate_cache):
    with KvgateServe(str(model_dir), "--served-model-name", "m", "--max-model-len", "256", "--engine-loop", "thread",
                     cache_dir=kvgate_cache) as server:
        yield server


@pytest.fixture(scope="module")
def override_server(model_dir, kvgate_cache):
    with KvgateServe(str(model_dir), "--served-model-name", "m", "--max-model-len", "256", "--engine-loop", "thread",
                     "--generation-config", "vllm", "--override-generation-config",
                     '{"temperature": 0, "max_new_tokens": 3, "do_sample": false}',
                     cache_dir=kvgate_cache) as server:
        yield server


def test_requests_that_leave_fields_out_get_the_models_defaults(auto_server):
    client = _client(auto_server)
    ignore_eos = {"ignore_eos": True}
    left_out = client.completions.create(model="m", prompt=PROMPT, extra_body=ignore_eos)
    greedy = client.completions.create(model="m", prompt=PROMPT, temperature=0, max_tokens=6, extra_body=ignore_eos)
    assert left_out.usage.completion_tokens == 6 and left_out.choices[0].finish_reason == "length"
    assert left_out.choices[0].text == greedy.choices[0].text  # temperature 0 from the file
    # auto: the model's max_new_tokens is the default, not a cap
    longer = client.completions.create(model="m", prompt=PROMPT, max_tokens=10, extra_body=ignore_eos)
    assert longer.usage.completion_tokens == 10
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                          extra_body=ignore_eos)
    assert chat.usage.completion_tokens == 6
    # what a request gives wins: sampled at temperature 1, two seeded samples differ
    sampled = client.completions.create(model="m", prompt=PROMPT, n=2, temperature=1.0, seed=3, max_tokens=16,
                                        extra_body=ignore_eos)
    assert sampled.choices[0].text != sampled.choices[1].text


def test_override_caps_every_request_and_vllm_drops_the_file(auto_server, override_server):
    """--generation-config vllm leaves the file out (its max_new_tokens 6 is not used), the override's temperature 0
    is greedy (the same tokens as the file's greedy), and the override's max_new_tokens caps even a request's own
    max_tokens, as vLLM caps it."""
    ignore_eos = {"ignore_eos": True}
    capped = _client(override_server).completions.create(model="m", prompt=PROMPT, max_tokens=10,
                                                         extra_body=ignore_eos)
    assert capped.usage.completion_tokens == 3
    greedy = _client(auto_server).completions.create(model="m", prompt=PROMPT, temperature=0, max_tokens=6,
                                                     extra_body=ignore_eos)
    assert greedy.choices[0].text.startswith(capped.choices[0].text)


@pytest.mark.parametrize("contents,flags,expected", [
    ({"temperature": -1.0}, [], "generation_config.json: temperature must be >= 0"),
    ({"top_p": 0.0}, [], "top_p must be in (0, 1]"),
    (None, ["--override-generation-config", '{"max_new_tokens": 0}'], "max_new_tokens must be an integer >= 1"),
    (None, ["--override-generation-config", "temperature=0"], "--override-generation-config is not JSON"),
    (None, ["--generation-config", "/nonexistent"], "no generation_config.json in that folder"),
])
def test_a_bad_default_stops_the_server_at_once(tmp_path, kvgate_cache, contents, flags, expected):
    folder = tmp_path / "model"
    build_demo_model(folder)
    if contents is not None:
        (folder / "generation_config.json").write_text(json.dumps(contents))
    proc = subprocess.run([KVGATE, "serve", str(folder), *flags], capture_output=True, text=True, timeout=120,
                          env={"KVGATE_CACHE_DIR": str(kvgate_cache), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2, proc.stderr
    error = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(error) == 1 and expected in error[0], proc.stderr


def test_defaults_read_as_vllm_reads_them(tmp_path, caplog):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.05,
         "max_new_tokens": 512, "do_sample": True}))
    auto = load_generation_defaults(str(tmp_path))
    assert auto.sampling == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.05}
    assert (auto.max_tokens, auto.max_tokens_cap) == (512, None)
    assert auto.max_tokens_for(None, 4000) == 512 and auto.max_tokens_for(None, 100) == 100
    assert auto.max_tokens_for(2000, 4000) == 2000
    assert auto.fill({"temperature": None, "top_p": 0.5}) == {"temperature": 0.6, "top_p": 0.5}
    assert load_generation_defaults(str(tmp_path), "vllm").sampling == {}
    assert load_generation_defaults(str(tmp_path / "no-such-model")).sampling == {}  # a sim backend's name
    folder = load_generation_defaults("elsewhere", str(tmp_path))  # a folder given: its max_new_tokens caps
    assert folder.sampling == auto.sampling and folder.max_tokens_cap == 512
    assert folder.max_tokens_for(2000, 4000) == 512
    with caplog.at_level(logging.WARNING, logger="kvgate.engine"):
        over = load_generation_defaults(str(tmp_path), "auto", {"temperature": 0.2, "max_new_tokens": 64,
                                                                "num_beams": 4})
    assert over.sampling["temperature"] == 0.2 and (over.max_tokens, over.max_tokens_cap) == (64, 64)
    assert "num_beams not used" in caplog.text
    with pytest.raises(ConfigError, match="must be a JSON object"):
        parse_override("[1, 2]")
    with pytest.raises(ConfigError, match="top_k"):
        load_generation_defaults(str(tmp_path), "vllm", {"top_k": 2.5})
    with pytest.raises(ConfigError, match="temperature must be a finite number"):
        load_generation_defaults(str(tmp_path), "vllm", parse_override('{"temperature": NaN}'))


def test_offline_llm_default_sampling_params(model_dir):
    from kvgate.engine import LLM

    llm = LLM(str(model_dir), max_model_len=256)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.max_tokens) == (0.0, 6)
    out = llm.generate(["abc"])
    assert len(out[0].outputs[0].token_ids) <= 6
    plain = LLM(str(model_dir), max_model_len=256, generation_config="vllm").get_default_sampling_params()
    assert (plain.temperature, plain.max_tokens) == (1.0, 16)  # vLLM's SamplingParams defaults
