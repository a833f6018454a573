"""Multi-LoRA through a real `kvgate serve`: vLLM's flags, `model` choosing an adapter (answers equal to the offline
engine's, which test_lora_parity.py holds to PEFT), /v1/models with `parent`, vLLM's runtime load / unload endpoints
behind VLLM_ALLOW_RUNTIME_LORA_UPDATING while other adapters' requests stream (none fails), and
vllm:lora_requests_info following it all, parsed by the EPP's own metrics reader."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from kvgate.engine import LLM, SamplingParams
from kvgate.engine.lora.request import LoRARequest
from tests.engine.test_lora_parity import ADAPTERS, make_adapter
from tests.procs import KvgateServe

pytestmark = pytest.mark.processes

PROMPT = "the quick brown fox"
STREAM_TOKENS = 480  # the load / unload test's streams: as long as --max-model-len 512 allows, so they outlast it


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """(model folder, {name: adapter folder}) for a tiny llama and three random adapters."""
    folder, _ = tiny_model_dir("llama")
    root = tmp_path_factory.mktemp("lora-http")
    paths = {}
    for seed, (name, config) in enumerate(ADAPTERS.items()):
        paths[name] = root / name
        make_adapter(folder, paths[name], seed, **config)
    return folder, paths


@pytest.fixture(scope="module")
def expected(adapters):
    """Greedy completions of PROMPT per adapter (None: the base model) from the offline engine."""
    folder, paths = adapters
    llm = LLM(str(folder), max_model_len=256, enable_lora=True, max_loras=3)
    outs = {}
    for i, (name, path) in enumerate([(None, None), *paths.items()]):
        lora = LoRARequest(name, i, str(path)) if name else None
        if lora:
            llm.add_lora(lora)
        out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), lora_request=lora)
        outs[name] = out[0].outputs[0].text
    return outs


@pytest.fixture(scope="module")
def server(adapters, kvgate_cache):
    folder, paths = adapters
    with KvgateServe(str(folder), "--served-model-name", "tiny", "--max-model-len", "512", "--engine-loop",
                     "process", "--enable-lora", "--max-loras", "2", "--lora-modules",
                     f"all-r8={paths['all-r8']}", f'{{"name": "attn-r4-rslora", "path": "{paths["attn-r4-rslora"]}"}}',
                     cache_dir=kvgate_cache, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}) as s:
        yield s


def _complete(url: str, model: str, max_tokens: int = 16, **extra) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=60, json={
        "model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, **extra})


def test_model_chooses_the_adapter(server, expected):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    for model, name in (("tiny", None), ("all-r8", "all-r8"), ("attn-r4-rslora", "attn-r4-rslora")):
        r = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0.0,
                                      extra_body={"ignore_eos": True})
        assert r.model == model and r.choices[0].text == expected[name], model
    assert len({expected[n] for n in (None, "all-r8", "attn-r4-rslora")}) == 3  # the adapters really differ
    chat = client.chat.completions.create(model="all-r8", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.model == "all-r8"
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny", "all-r8", "attn-r4-rslora"}
    assert models["all-r8"].parent == "tiny" and models["tiny"].parent is None
    missing = _complete(server.url, "nope")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    assert "all-r8" in missing.json()["error"]["message"]


def _lora_info(url: str) -> dict:
    from kvgate.epp.datalayer.dialects import DIALECTS
    from kvgate.epp.datalayer.exposition import parse_metrics

    metrics = parse_metrics(httpx.get(url + "/metrics", timeout=5).text, DIALECTS["vllm"])
    return {"max": metrics.max_lora, "running": set(metrics.running_loras), "waiting": set(metrics.waiting_loras)}


def test_runtime_load_and_unload_while_others_stream(server, adapters, expected):
    _, paths = adapters
    failures, done, answered = [], [], []

    def stream(model: str) -> None:
        try:
            with httpx.stream("POST", server.url + "/v1/completions", timeout=120, json={
                    "model": model, "prompt": PROMPT, "max_tokens": STREAM_TOKENS, "ignore_eos": True,
                    "stream": True}) as r:
                chunks = r.iter_text()
                body = next(chunks, "")  # the first token: the engine runs the request
                answered.append(model)
                body += "".join(chunks)
            if r.status_code != 200 or '"error"' in body or "[DONE]" not in body:
                failures.append((model, r.status_code, body[-300:]))
            done.append(model)
        except Exception as exc:  # noqa: BLE001 - counted, then asserted
            failures.append((model, repr(exc)))

    threads = [threading.Thread(target=stream, args=(m,)) for m in ("all-r8", "attn-r4-rslora", "tiny") * 2]
    for t in threads:
        t.start()
    # Unload only once every stream has its first token: a thread the OS starts late would send its request
    # after the unload and be refused, as a new request should be (CI saw it once under load).
    for _ in range(600):
        if len(answered) + len(failures) == len(threads):
            break
        time.sleep(0.02)
    assert len(answered) == len(threads), failures
    seen_running = set()
    for _ in range(100):  # the metric shows the adapters of running requests (the EPP's lora-affinity-scorer input)
        info = _lora_info(server.url)
        seen_running |= info["running"]
        if {"all-r8", "attn-r4-rslora"} <= seen_running:
            break
        time.sleep(0.02)
    assert info["max"] == 2 and {"all-r8", "attn-r4-rslora"} <= seen_running

    # Unloaded first, at once, so that its streams are surely still running (they last STREAM_TOKENS decode steps).
    unloaded = httpx.post(server.url + "/v1/unload_lora_adapter", timeout=60, json={"lora_name": "attn-r4-rslora"})
    assert unloaded.status_code == 200 and "removed successfully" in unloaded.text
    assert len(done) < len(threads), "the streams ended before the unload: nothing was tested under load"
    loaded = httpx.post(server.url + "/v1/load_lora_adapter", timeout=60,
                        json={"lora_name": "mlp-r16", "lora_path": str(paths["mlp-r16"])})
    assert loaded.status_code == 200 and "added successfully" in loaded.text
    assert _complete(server.url, "attn-r4-rslora").status_code == 404  # new requests are refused at once
    # The new adapter waits for a slot (both hold adapters with running requests), then answers as offline.
    r = _complete(server.url, "mlp-r16")
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected["mlp-r16"]
    for t in threads:
        t.join(120)
    assert not failures and len(done) == 6, failures  # the unloaded adapter's running requests finished too
    ids = {m["id"] for m in httpx.get(server.url + "/v1/models", timeout=10).json()["data"]}
    assert ids == {"tiny", "all-r8", "mlp-r16"}
    info = _lora_info(server.url)
    assert info == {"max": 2, "running": set(), "waiting": set()}


@pytest.mark.parametrize("body, status, says", [
    ({"lora_name": "all-r8", "lora_path": "/nonexistent"}, 400, "already served"),
    ({"lora_name": "tiny", "lora_path": "/nonexistent"}, 400, "base model"),
    ({"lora_name": "x", "lora_path": "/nonexistent"}, 400, "does not exist"),
    ({"lora_name": "", "lora_path": "/x"}, 400, "lora_name"),
])
def test_bad_loads_are_400s(server, body, status, says):
    r = httpx.post(server.url + "/v1/load_lora_adapter", json=body, timeout=30)
    assert r.status_code == status and says in r.text, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_a_wrong_shape_adapter_is_refused_when_loaded(server, tmp_path, tiny_model_dir):
    folder, _ = tiny_model_dir("qwen3")  # head_dim 32: its q_proj adapter does not fit the llama
    make_adapter(folder, tmp_path / "qwen3-adapter", 0, r=4, lora_alpha=8, target_modules=["q_proj"])
    r = httpx.post(server.url + "/v1/load_lora_adapter", timeout=30,
                   json={"lora_name": "misfit", "lora_path": str(tmp_path / "qwen3-adapter")})
    assert r.status_code == 400 and "this model needs" in r.json()["error"]["message"], r.text
    assert "misfit" not in {m["id"] for m in httpx.get(server.url + "/v1/models", timeout=10).json()["data"]}


def test_unload_unknown_is_404(server):
    r = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "never"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_runtime_endpoints_are_off_by_default_and_sim_adapters_write_their_own_text(adapters, kvgate_cache):
    _, paths = adapters
    with KvgateServe("sim-8b", "--backend", "sim", "--enable-lora", "--lora-modules", f"a={paths['all-r8']}",
                     cache_dir=kvgate_cache, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": ""}) as sim:
        # before its first request an engine already shows its free slot (the lora-affinity-scorer's 0.6)
        assert _lora_info(sim.url) == {"max": 1, "running": set(), "waiting": set()}
        r = httpx.post(sim.url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": "/x"}, timeout=10)
        assert r.status_code == 404
        base, adapted = (_complete(sim.url, m).json()["choices"][0]["text"] for m in ("sim-8b", "a"))
        assert base != adapted


def test_lora_flags_are_checked_before_anything_starts(capsys):
    from kvgate.cli import main

    assert main(["serve", "x", "--backend", "sim", "--lora-modules", "a=/x"]) == 2
    assert "enable_lora" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "x", "--enable-lora", "--lora-modules", "no-equals-sign"])
    assert "name=path" in capsys.readouterr().err
