"""The KV room: whether one more copy of a prefix fits each candidate endpoint's KV cache.

The prefix-group balance's fit check (fitKvCapacity φ > 0) keeps, per endpoint, the footprints of the prefix groups
picked there within its window, and produces for each cycle (computed at its first read: only a spill reads it),
per candidate e:

    footprint(e)   the footprints of the groups e serves, less the request's own group
    limit(e)       φ × e's KV cache in tokens (unbounded where its size is unknown)

A copy of p prompt tokens fits e where footprint(e) + p ≤ limit(e). The affinity filter's spill reads it: a spill
that lands where the copy does not fit evicts the endpoint's other groups, and they come back as cold prefills
(`kvgate bench routing --workloads hot-tenant --configs kvgate-no-spill,kvgate-spill-anywhere`,
docs/benchmarks.md). A profile without a fit check produces none, and the filter spills anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvgate.epp.scheduling.data import DataKey, PerEndpoint
from kvgate.epp.types import EndpointState

KV_ROOM = DataKey("kv-room", "keep fitKvCapacity on one")


@dataclass(frozen=True)
class KvRoom:
    footprint: PerEndpoint
    limit: PerEndpoint

    def fits(self, endpoints: Sequence[EndpointState], prompt_tokens: int) -> np.ndarray:
        """Per endpoint, whether a copy of `prompt_tokens` fits beside the groups it serves."""
        return self.footprint.of(endpoints) + prompt_tokens <= self.limit.of(endpoints)
