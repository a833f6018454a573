"""How the affinity filter's spill asks whether one more copy of a prefix fits an endpoint's KV cache.

The prefix-group balance's fit check (fitKvCapacity > 0) keeps, per endpoint, the footprints of the prefix groups
picked there within its window; a copy fits where those footprints plus the prompt stay within φ × the endpoint's
KV cache. A spill that lands where the copy does not fit evicts the endpoint's other groups, and they come back as
cold prefills (`kvgate bench routing --workloads hot-tenant --configs kvgate-no-spill,kvgate-spill-anywhere`,
docs/benchmarks.md), so the filter asks the same record before it spills. A consumer (NeedsKvFit) is handed the
profile's check when the config is built (`wire_kv_fit_checks`); a profile without one leaves it None, and the
consumer spills anywhere.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from kvgate.epp.scheduling.framework import Plugin
from kvgate.epp.types import EndpointState, LLMRequest


@runtime_checkable
class KvFitCheck(Protocol):
    name: str

    def checks_fit(self) -> bool:
        """Whether this plugin keeps footprints to answer copy_fits (its fit check is on)."""

    def copy_fits(self, request: LLMRequest, endpoints: list[EndpointState], prompt_tokens: int) -> list[bool]:
        """Per endpoint, whether it can hold the request's prompt beside the groups it already serves (True where its
        KV size is unknown)."""


class NeedsKvFit:
    """Mixin for plugins that ask a KvFitCheck; `kv_fit` stays None when the profile has none, or the plugin
    does not want one (`wants_kv_fit` False)."""

    kv_fit: KvFitCheck | None = None

    def wants_kv_fit(self) -> bool:
        return True


def wire_kv_fit_checks(plugins: list[Plugin]) -> None:
    """Give every NeedsKvFit plugin of one profile that wants one the profile's fit check; ValueError when the
    profile has several (which one would be a guess)."""
    checks = list({p.name: p for p in plugins if isinstance(p, KvFitCheck) and p.checks_fit()}.values())
    for plugin in plugins:
        if not isinstance(plugin, NeedsKvFit) or not plugin.wants_kv_fit():
            continue
        if len(checks) > 1:
            raise ValueError(f"plugin {plugin.name!r}: the profile has several KV fit checks "
                             f"({sorted(c.name for c in checks)}); keep fitKvCapacity on one")
        plugin.kv_fit = checks[0] if checks else None
