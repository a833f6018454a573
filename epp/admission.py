"""Saturation detection and admission: shed sheddable requests (priority < 0) when the pool has no headroom.

An endpoint has headroom when its metrics are fresh, its waiting queue is below `queue_depth_threshold` and its
KV-cache use is below `kv_cache_threshold`. The pool is saturated when no endpoint has headroom — stale
endpoints count as saturated (we cannot tell), and an empty pool is saturated. Requests with priority >= 0 are
always admitted: shedding only protects them from sheddable load (upstream's legacy admission controller).
The director passes, per endpoint, the requests it routed there since the scrape (`unseen`): a burst counts
in the queue at once, not one scrape round later.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvgate.epp.types import EndpointState, LLMRequest


class Admission:
    def __init__(self, queue_depth_threshold: int = 5, kv_cache_threshold: float = 0.8) -> None:
        if queue_depth_threshold <= 0:
            raise ValueError(f"queue_depth_threshold must be positive, got {queue_depth_threshold}")
        if not 0 < kv_cache_threshold <= 1:
            raise ValueError(f"kv_cache_threshold must be in (0, 1], got {kv_cache_threshold}")
        self.queue_depth_threshold = queue_depth_threshold
        self.kv_cache_threshold = kv_cache_threshold

    @classmethod
    def from_config(cls, saturation) -> "Admission":
        """From config.SaturationConfig (the `saturationDetector` section of an EndpointPickerConfig)."""
        return cls(saturation.queue_depth_threshold, saturation.kv_cache_util_threshold)

    def has_headroom(self, endpoint: EndpointState, unseen: float = 0) -> bool:
        m = endpoint.metrics
        return (not endpoint.stale and m.waiting_queue_size + unseen < self.queue_depth_threshold
                and m.kv_cache_usage < self.kv_cache_threshold)

    def is_saturated(self, endpoints: Sequence[EndpointState], unseen: Sequence[float] | None = None) -> bool:
        """`unseen[i]`: requests routed to endpoints[i] that its scraped queue does not show yet."""
        if unseen is None:
            return not any(self.has_headroom(e) for e in endpoints)
        return not any(self.has_headroom(e, u) for e, u in zip(endpoints, unseen))

    def room(self, endpoints: Sequence[EndpointState], unseen: Sequence[float]) -> int:
        """How many more requests the endpoints take before every one is saturated: per endpoint with headroom,
        the queue threshold less its waiting and not-yet-scraped requests (flow control's dispatch gate)."""
        total = 0
        for e, u in zip(endpoints, unseen):
            if self.has_headroom(e, u):
                total += math.ceil(self.queue_depth_threshold - e.metrics.waiting_queue_size - u)
        return total

    def admit(self, request: LLMRequest, endpoints: Sequence[EndpointState],
              unseen: Sequence[float] | None = None) -> bool:
        """False = reject with 429: a sheddable request while the pool is saturated."""
        if request.priority >= 0:
            return True
        return not self.is_saturated(endpoints, unseen)
