"""Offline API: `LLM(model, **engine_args).generate(prompts, sampling_params)`, as in vLLM."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from kvgate.engine.config import EngineConfig
from kvgate.common.errors import InvalidRequestError
from kvgate.engine.generation_defaults import GenerationDefaults, load_generation_defaults
from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.lora.request import LoRARequest
from kvgate.engine.outputs import CompletionOutput, RequestOutput
from kvgate.engine.sampling_params import SamplingParams

PromptType = str | list[int] | dict


def resolve_model_path(model: str) -> str:
    """`demo` names the built-in demo model (built on first use), `copier` the tiny model trained here to quote
    its prompt (engine/copier.py), `copier-wide` the copier inside a 0.37B-parameter Llama (engine/copier_wide.py);
    anything else is a local folder."""
    if model == "demo":
        from kvgate.common.demo import ensure_demo_model

        return str(ensure_demo_model())
    if model == "copier":
        from kvgate.engine.copier import ensure_copier_model

        return str(ensure_copier_model())
    if model == "copier-wide":
        from kvgate.engine.copier_wide import ensure_wide_copier

        return str(ensure_wide_copier())
    return model


class LLM:
    def __init__(self, model: str, **engine_args) -> None:
        served = engine_args.pop("served_model_name", None) or model
        self._attach(LLMEngine(EngineConfig(model=resolve_model_path(model), served_model_name=served, **engine_args)))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        llm = cls.__new__(cls)
        llm._attach(LLMEngine(config))
        return llm

    def _attach(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._generation_defaults: GenerationDefaults | None = None
        self._ids = itertools.count()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        cache_salt: str | Sequence[str | None] | None = None,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text, token ids, or {"prompt_token_ids": [...]}); outputs in input order.
        `lora_request`: one adapter for all prompts or one per prompt (None: the base model); each must have been
        added (`LLM(..., enable_lora=True)` then `add_lora`)."""
        prompts = _as_prompt_list(prompts)
        params = _broadcast(sampling_params or self.get_default_sampling_params(), len(prompts), "sampling_params")
        salts = _broadcast(cache_salt, len(prompts), "cache_salt")
        loras = _broadcast(lora_request, len(prompts), "lora_request")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        ids: list[str] = []
        try:
            for prompt, p, salt, prio, lora in zip(prompts, params, salts, priorities, loras):
                rid = f"offline-{next(self._ids)}"
                self.engine.add_request(rid, _prompt_input(prompt), p, cache_salt=salt, priority=prio,
                                        lora_request=lora)
                ids.append(rid)
        except Exception:
            for rid in ids:  # a bad prompt rejects the whole call, leaving the engine as it was
                self.engine.abort_request(rid)
            raise
        return self._run(ids)

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() uses without sampling_params (vLLM's method): SamplingParams' defaults with the model's
        recommended ones over them (--generation-config; max_new_tokens as max_tokens)."""
        if self._generation_defaults is None:
            config = self.engine.config
            self._generation_defaults = load_generation_defaults(config.model, config.generation_config,
                                                                 config.override_generation_config)
        defaults = self._generation_defaults
        extra = {"max_tokens": defaults.max_tokens} if defaults.max_tokens is not None else {}
        return SamplingParams(**defaults.sampling, **extra)

    def add_lora(self, lora: LoRARequest) -> None:
        self.engine.add_lora(lora)

    def remove_lora(self, lora_name: str) -> bool:
        return self.engine.remove_lora(lora_name)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             **kwargs) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": _chat_token_ids(self.tokenizer, conv)} for conv in conversations
        ]
        return self.generate(prompts, sampling_params, **kwargs)

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        finals: dict[str, dict[int, CompletionOutput]] = {rid: {} for rid in ids}
        last: dict[str, RequestOutput] = {}
        pending = set(ids)
        while pending:
            if not self.engine.has_unfinished_requests():
                raise RuntimeError(f"engine stopped with requests unfinished: {sorted(pending)}")
            outputs = self.engine.step(final_only=True)  # only finished samples are kept below
            failed = [(rid, exc) for rid, exc in self.engine.take_failures() if rid in pending]
            if failed:
                for rid in pending:
                    self.engine.abort_request(rid)
                raise failed[0][1]
            for out in outputs:
                if out.request_id not in finals:
                    continue
                for c in out.outputs:
                    if c.finished:
                        finals[out.request_id][c.index] = c
                last[out.request_id] = out
                if out.finished:
                    pending.discard(out.request_id)
        results = []
        for rid in ids:
            out = last[rid]
            completions = [finals[rid][i] for i in sorted(finals[rid])]
            results.append(RequestOutput(rid, out.prompt, out.prompt_token_ids, completions, True,
                                         out.num_cached_tokens, out.metrics, out.prompt_logprobs))
        return results


def _chat_token_ids(tokenizer, conversation: list[dict]) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("this model's tokenizer has no chat template")
    ids = tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _prompt_input(prompt) -> str | list[int]:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
        raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, (str, list)):
        return prompt
    raise InvalidRequestError(f"a prompt must be a string, token ids or a dict, got {type(prompt).__name__}")


def _broadcast(value, n: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise InvalidRequestError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n
