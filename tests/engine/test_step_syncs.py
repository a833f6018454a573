"""No device-to-host wait inside an engine step, whatever the requests sample with.

Two ways a step can wait for the device:
- inside ModelRunner.launch, by reading a tensor on the host (.item(), .tolist(), .cpu(), .numpy(), bool(t),
  int(t), float(t), torch.nonzero, a copy to the CPU): counted by patching those entry points for the duration of
  launch (on CPU every one of them is where a CUDA run would wait), and on CUDA by torch's own sync debug mode;
- between steps, by taking a step's tokens before the next step is queued (synchronous scheduling): counted from
  the order of the runner's launches and the steps' result() calls.
With async scheduling, a batch of greedy, top-k/top-p, penalized, min_tokens, logit-biased or mixed requests does
neither; requests with logprobs wait only in result(), once per step, for tokens and logprobs together.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from kvgate.engine import LLM, SamplingParams
from kvgate.engine.model_runner import PendingStep
from tests.engine.tiny_models import random_tokens

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
TOP_K_TOP_P = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, max_tokens=8, ignore_eos=True)
TOP_P_ONLY = SamplingParams(temperature=0.9, top_p=0.8, max_tokens=8, ignore_eos=True, seed=5)
PENALTIES = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.05, presence_penalty=0.3,
                           frequency_penalty=0.2, max_tokens=8, ignore_eos=True)
GREEDY_PENALIZED = SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=8, ignore_eos=True)
EXTRAS = SamplingParams(temperature=0.8, min_p=0.05, min_tokens=4, stop_token_ids=[3], logit_bias={7: 1.5}, max_tokens=8,
                        ignore_eos=True, seed=11)
LOGPROBS = SamplingParams(temperature=0.7, top_p=0.9, logprobs=3, max_tokens=8, ignore_eos=True)

BATCHES = {
    "greedy": [GREEDY] * 4,
    "top-k/top-p": [TOP_K_TOP_P] * 4,
    "top-p only, seeded": [TOP_P_ONLY] * 3,
    "penalties": [PENALTIES, GREEDY_PENALIZED] * 2,
    "mixed": [GREEDY, TOP_K_TOP_P, TOP_P_ONLY, PENALTIES, GREEDY_PENALIZED, EXTRAS],
    "logprobs": [LOGPROBS, GREEDY, LOGPROBS],
}

# Tensor methods and functions that read a tensor's values on the host.
_HOST_READS = ["item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "nonzero"]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    folder, _ = tiny_model_dir("qwen2")
    return LLM(str(folder), max_model_len=128, async_scheduling=True)


class StepRecorder:
    """Counts host reads inside ModelRunner.launch and the order of launches and result() calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, runner) -> None:
        self.reads: Counter = Counter()
        self.events: list[tuple[str, int]] = []  # ("launch", n) / ("result", n): step n launched / waited on
        self._in_launch = 0
        self._ids: dict[int, int] = {}
        self._steps: list = []
        for name in _HOST_READS:
            monkeypatch.setattr(torch.Tensor, name, self._counting(name, getattr(torch.Tensor, name)))
        monkeypatch.setattr(torch, "nonzero", self._counting("torch.nonzero", torch.nonzero))
        monkeypatch.setattr(torch.Tensor, "to", self._counting_to(torch.Tensor.to))
        launch, result = runner.launch, PendingStep.result

        def recorded_launch(*args, **kwargs):
            self._in_launch += 1
            try:
                step = launch(*args, **kwargs)
            finally:
                self._in_launch -= 1
            self._steps.append(step)  # kept alive: an id() is never reused while the recorder maps it
            self._ids[id(step)] = n = len(self._ids)
            self.events.append(("launch", n))
            return step

        def recorded_result(step):
            if id(step) in self._ids:
                self.events.append(("result", self._ids[id(step)]))
            return result(step)

        monkeypatch.setattr(runner, "launch", recorded_launch)
        monkeypatch.setattr(PendingStep, "result", recorded_result)

    def _counting(self, name, original):
        def wrapper(*args, **kwargs):
            if self._in_launch:
                self.reads[name] += 1
            return original(*args, **kwargs)
        return wrapper

    def _counting_to(self, original):
        def wrapper(tensor, *args, **kwargs):
            target = kwargs.get("device", args[0] if args else None)
            if self._in_launch and isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu" \
                    and tensor.device.type != "cpu":
                self.reads["to(cpu)"] += 1
            return original(tensor, *args, **kwargs)
        return wrapper

    def stalls(self) -> int:
        """Steps whose tokens were waited for before the next step was queued (a step the device then idles
        through on the host's turn)."""
        position = {event: i for i, event in enumerate(self.events)}
        launched = [n for kind, n in self.events if kind == "launch"]
        return sum(1 for n in launched[:-1]
                   if ("result", n) in position and position[("result", n)] < position[("launch", n + 1)])


@pytest.mark.parametrize("name", list(BATCHES))
def test_no_host_wait_inside_a_step(llm, monkeypatch, name):
    params = BATCHES[name]
    engine = llm.engine
    for i, p in enumerate(params):
        engine.add_request(f"{name}-{i}", random_tokens(6 + 3 * i, 40 + i), p)
    recorder = StepRecorder(monkeypatch, engine.runner)
    finished = set()
    for _ in range(100):  # bounded: 8 tokens each
        if not engine.has_unfinished_requests():
            break
        finished.update(o.request_id for o in engine.step() if o.finished)
        assert engine.scheduler.num_host_bound == 0
    assert len(finished) == len(params)
    monkeypatch.undo()
    assert sum(1 for kind, _ in recorder.events if kind == "launch") >= 8
    assert dict(recorder.reads) == {}, f"{name}: host reads inside launch"
    assert recorder.stalls() == 0, f"{name}: steps waited for before the next was queued: {recorder.events}"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", [n for n in BATCHES if n != "logprobs"])
def test_no_cuda_sync_in_sampling(tiny_model_dir, name):
    """torch's sync debug mode raises on any synchronising CUDA call made while a step samples and queues the copy
    of its tokens (the forward pass before it is the CUDA graphs' and the kernels' own business)."""
    folder, _ = tiny_model_dir("qwen2")
    llm = LLM(str(folder), device="cuda", dtype="bfloat16", max_model_len=128, async_scheduling=True)
    runner = llm.engine.runner
    sample, copy_back = runner._sample, PendingStep.copy_back

    def strict(call):
        def wrapper(*args, **kwargs):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return call(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return wrapper

    runner._sample = strict(sample)
    PendingStep.copy_back = strict(copy_back)
    try:
        for i, p in enumerate(BATCHES[name]):
            llm.engine.add_request(f"{name}-{i}", random_tokens(6 + 3 * i, 40 + i), p)
        for _ in range(100):
            if not llm.engine.has_unfinished_requests():
                break
            llm.engine.step()
    finally:
        PendingStep.copy_back = copy_back
    assert not llm.engine.has_unfinished_requests()
