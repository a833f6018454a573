"""Builders for EPP unit tests: endpoint states and requests with only the fields a test cares about."""

from __future__ import annotations

import time

from kvgate.epp.types import Endpoint, EndpointMetrics, EndpointState, LLMRequest


def state(address: str, *, queue: int = 0, running: int = 0, kv: float = 0.0, max_lora: int = 0,
          running_loras=(), waiting_loras=(), tokens: int = 0, stale: bool = False,
          block_size: int | None = None) -> EndpointState:
    metrics = EndpointMetrics(waiting_queue_size=queue, running_requests=running, kv_cache_usage=kv,
                              max_lora=max_lora, running_loras=frozenset(running_loras),
                              waiting_loras=frozenset(waiting_loras), kv_block_size=block_size,
                              updated_at=time.monotonic())
    return EndpointState(Endpoint(address), metrics, stale=stale, in_flight_tokens=tokens)


def request(prompt: str = "hello", *, model: str = "m", request_id: str = "r1", headers=None,
            priority: int = 0, cache_salt: str | None = None, max_tokens: int | None = None,
            body=None) -> LLMRequest:
    return LLMRequest(request_id=request_id, model=model, target_model=model, prompt=prompt,
                      headers=headers or {}, priority=priority, cache_salt=cache_salt, max_tokens=max_tokens,
                      body=body)


def addresses(states) -> list[str]:
    return [s.address for s in states]


# An EndpointPickerConfig whose picker answers with a list (primary, then fallbacks).
LIST_CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: max-score-picker
  parameters: {maxNumOfEndpoints: 3}
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
  - pluginRef: max-score-picker
"""
