"""lm-evaluation-harness against `kvgate up` through its gateway, with its `local-completions` backend: a local
loglikelihood (multiple-choice) task and a generate task, both from a local JSON Lines file (nothing downloaded).
Each request's loglikelihood equals HF transformers' for the same model and tokens (fp32, within 1e-4), and each
greedy generation equals HF's."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.procs import free_port
from tests.test_up import read_until_up, start_up

pytestmark = pytest.mark.processes

TOLERANCE = 1e-4
MAX_GEN = 6

QUESTIONS = [
    {"question": "The capital of France is", "choices": [" Paris", " Rome", " a city by the sea"], "answer": 0},
    {"question": "Two plus two equals", "choices": [" four", " five"], "answer": 0},
    {"question": "Water boils at", "choices": [" 100 degrees", " the moon", " 7"], "answer": 0},
]
PROMPTS = [{"question": "Once upon a time", "answer": " there"}, {"question": "Q: hello?\nA:", "answer": " hi"}]

LOGLIKELIHOOD_TASK = """task: kvgate_local_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""
GENERATE_TASK = """task: kvgate_local_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {max_gen}
  do_sample: false
metric_list:
  - metric: exact_match
"""


def write_tasks(folder: Path) -> None:
    for name, rows, template in (("choice", QUESTIONS, LOGLIKELIHOOD_TASK), ("generate", PROMPTS, GENERATE_TASK)):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (folder / f"{name}.yaml").write_text(template.format(data=data, max_gen=MAX_GEN))


# lm-eval's Python API in a process of its own (offline, its own environment), with only the local tasks indexed
# (its bundled thousands of task configs take longer to index than the whole evaluation takes to run). It prints
# each sample's arguments and responses as one JSON line.
RUN_LM_EVAL = """
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager

tasks, model_args = sys.argv[1], sys.argv[2]
results = lm_eval.simple_evaluate(model="local-completions", model_args=model_args,
                                  tasks=["kvgate_local_choice", "kvgate_local_generate"],
                                  task_manager=TaskManager(include_path=tasks, include_defaults=False),
                                  log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0)
for task, samples in results["samples"].items():
    for sample in samples:
        print(json.dumps({"task": task, "arguments": [list(a)[:2] for a in sample["arguments"]],
                          "resps": sample["resps"]}, default=str))
"""


def run_lm_eval(port: int, tokenizer: Path, tasks: Path, out: Path) -> list[dict]:
    """Both tasks' logged samples: {"task", "arguments": [[context, continuation or generation args]...],
    "resps": [[response] per argument]}."""
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_CACHE=str(out / "datasets"), TOKENIZERS_PARALLELISM="false")
    model_args = (f"model=demo,base_url=http://127.0.0.1:{port}/v1/completions,tokenizer_backend=huggingface,"
                  f"tokenizer={tokenizer},num_concurrent=1,max_retries=1,timeout=120")
    proc = subprocess.run([sys.executable, "-c", RUN_LM_EVAL, str(tasks), model_args], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    samples = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(samples) == len(QUESTIONS) + len(PROMPTS), proc.stderr[-3000:]
    return samples


def hf_loglikelihood(model, tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    """What lm-eval's causal LMs score: context and continuation tokenized whole then split (no BOS), the
    continuation's summed logprobs, and whether each of its tokens is the argmax."""
    context_ids = tokenizer(context, add_special_tokens=False).input_ids
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    with torch.no_grad():
        logprobs = model(torch.tensor([whole])).logits[0].float().log_softmax(dim=-1)
    rows = logprobs[len(context_ids) - 1:len(whole) - 1]
    targets = torch.tensor(whole[len(context_ids):])
    chosen = rows.gather(1, targets[:, None]).squeeze(1)
    return chosen.sum().item(), bool((rows.argmax(dim=-1) == targets).all())


def hf_greedy_text(model, tokenizer, prompt: str) -> str:
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=MAX_GEN, do_sample=False, eos_token_id=None, pad_token_id=0)
    return tokenizer.decode(out[0, len(ids):]).split("\n")[0]


def test_lm_eval_through_the_gateway_matches_hf(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    port = free_port()
    proc = start_up(tmp_path, port, "--replicas", "1")
    try:
        read_until_up(proc, 240)
        model_dir = tmp_path / "cache" / "models" / "demo-v1"
        assert (model_dir / "model.safetensors").is_file()
        tasks, out = tmp_path / "tasks", tmp_path / "out"
        tasks.mkdir()
        out.mkdir()
        write_tasks(tasks)
        samples = run_lm_eval(port, model_dir, tasks, out)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    scored = generated = 0
    for sample in samples:
        if sample["task"] == "kvgate_local_choice":
            for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
                got_ll, got_greedy = resp[0]
                want_ll, want_greedy = hf_loglikelihood(model, tokenizer, context, continuation)
                assert abs(got_ll - want_ll) < TOLERANCE, (context, continuation, got_ll, want_ll)
                assert got_greedy == want_greedy
                scored += 1
        else:
            assert sample["resps"][0][0] == hf_greedy_text(model, tokenizer, sample["arguments"][0][0])
            generated += 1
    assert scored == sum(len(q["choices"]) for q in QUESTIONS) and generated == len(PROMPTS)
