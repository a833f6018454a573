"""The `flowControl` section of an EndpointPickerConfig, and its feature gate, in upstream's shape:

    featureGates: [flowControl]           # without the gate the section is read, checked and not used
    plugins:
    - type: round-robin-fairness-policy   # policies are plugins a band names (by name; the name defaults to the type)
    - type: edf-ordering-policy
    flowControl:
      maxRequests: 5000                   # all bands together (default 5000)
      maxBytes: 1Gi                       # request bodies held, all bands together (default 1 GiB)
      defaultRequestTTL: 60s              # a held request is answered 429 (sheddable) / 503 after this long
      defaultPriorityBand:                # the template of a band no entry below names
        maxRequests: 5000
        maxBytes: 1Gi
        fairnessPolicyRef: global-strict-fairness-policy
        orderingPolicyRef: fcfs-ordering-policy
      priorityBands:
      - priority: 100
        maxBytes: 500Mi
        fairnessPolicyRef: round-robin-fairness-policy
        orderingPolicyRef: edf-ordering-policy

Quantities take Kubernetes' forms (5000, "1Gi", "500M"); durations Go's ("30s", "1m30s"). Fairness policies:
global-strict-fairness-policy (every flow of a band in one order, so a flood can starve the others) and
round-robin-fairness-policy (the band's flows take turns). Ordering within a flow: fcfs-ordering-policy,
edf-ordering-policy (earliest deadline first: arrival + the request's x-slo-ttft-ms, else + the TTL), or kvgate's
shortest-prompt-first-ordering-policy (arrival + `msPerPromptToken` (2) ms per prompt token as the EPP estimates
it, characters / 4: short prompts leave before long ones that came a little earlier, and a long one waits at most
its length × msPerPromptToken behind them — shortest-job-first with aging, which at saturation cuts the TTFT of
most requests for the wait of the longest; `kvgate bench routing` numbers in docs/benchmarks.md). Every limit is
finite: a pool cannot be made to hold unbounded memory by a config that leaves them out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from decimal import Decimal, InvalidOperation
from typing import Any

from kubernetes.utils.quantity import parse_quantity

FEATURE_GATE = "flowControl"
GLOBAL_STRICT = "global-strict-fairness-policy"
ROUND_ROBIN = "round-robin-fairness-policy"
FCFS = "fcfs-ordering-policy"
EDF = "edf-ordering-policy"
SPF = "shortest-prompt-first-ordering-policy"  # kvgate's
FAIRNESS_POLICIES = {GLOBAL_STRICT, ROUND_ROBIN}
ORDERING_POLICIES = {FCFS, EDF, SPF}
POLICY_TYPES = FAIRNESS_POLICIES | ORDERING_POLICIES
# upstream's defaults: 5000 requests and 1 GB per band, 60 s TTL
DEFAULT_MAX_REQUESTS = 5000
DEFAULT_MAX_BYTES = 1 << 30
DEFAULT_TTL_S = 60.0
MAX_PRIORITY_BANDS = 64  # configured entries; bands made from the template are bounded by the requests they hold
MAX_LIMIT = 1 << 50  # past a petabyte (or a quadrillion requests) a limit is a typo
# shortest-prompt-first's aging (`kvgate bench routing --configs kvgate,kvgate-spf`; not tuned on the held-out shapes)
DEFAULT_MS_PER_PROMPT_TOKEN = 2.0
MAX_MS_PER_PROMPT_TOKEN = 1000.0


class FlowConfigError(ValueError):
    """A flowControl section that cannot be used (the config parser turns it into its one-line ConfigError)."""


@dataclass(frozen=True)
class BandConfig:
    priority: int = 0
    max_requests: int = DEFAULT_MAX_REQUESTS
    max_bytes: int = DEFAULT_MAX_BYTES
    fairness: str = GLOBAL_STRICT
    ordering: str = FCFS
    ms_per_prompt_token: float = DEFAULT_MS_PER_PROMPT_TOKEN  # shortest-prompt-first's parameter


@dataclass(frozen=True)
class FlowControlConfig:
    enabled: bool = False  # the feature gate
    max_requests: int = DEFAULT_MAX_REQUESTS
    max_bytes: int = DEFAULT_MAX_BYTES
    default_ttl_s: float = DEFAULT_TTL_S
    default_band: BandConfig = field(default_factory=BandConfig)
    bands: Mapping[int, BandConfig] = field(default_factory=dict)

    def band(self, priority: int) -> BandConfig:
        """The configured band of this priority, else the template's copy for it."""
        found = self.bands.get(priority)
        return found if found is not None else replace(self.default_band, priority=priority)


def parse_flow_control(section: Any, feature_gates: Any, policy_plugins: Mapping[str, str], where: str,
                       parse_duration, show, policy_parameters: Mapping[str, Any] | None = None) -> FlowControlConfig:
    """`policy_plugins`: name → type of the fairness / ordering policy plugins the config declares;
    `policy_parameters`: name → their `parameters` (only shortest-prompt-first-ordering-policy takes any)."""
    params = _policy_parameters(policy_plugins, policy_parameters or {}, where, show)
    if feature_gates is None:
        gates = []
    elif isinstance(feature_gates, list) and all(isinstance(g, str) for g in feature_gates):
        gates = feature_gates
    else:
        raise FlowConfigError(f"{where}: featureGates must be a list of names, got {show(feature_gates)}")
    enabled = FEATURE_GATE in gates
    if section is None:
        return FlowControlConfig(enabled=enabled)
    where = f"{where}: flowControl"
    _fields(section, {"maxRequests", "maxBytes", "defaultRequestTTL", "defaultPriorityBand", "priorityBands"},
            where, show)
    max_requests = _quantity(section, "maxRequests", DEFAULT_MAX_REQUESTS, where, show)
    max_bytes = _quantity(section, "maxBytes", DEFAULT_MAX_BYTES, where, show)
    ttl = DEFAULT_TTL_S
    if "defaultRequestTTL" in section:
        try:
            ttl = parse_duration(section["defaultRequestTTL"])
        except ValueError as e:
            raise FlowConfigError(f"{where}: defaultRequestTTL: {e}") from e
    template = BandConfig(max_requests=max_requests, max_bytes=max_bytes)
    if section.get("defaultPriorityBand") is not None:
        template = _band(section["defaultPriorityBand"], template, policy_plugins, params,
                         f"{where}: defaultPriorityBand", show, needs_priority=False)
    bands: dict[int, BandConfig] = {}
    entries = section.get("priorityBands")
    if entries is not None:
        if not isinstance(entries, list):
            raise FlowConfigError(f"{where}: priorityBands must be a list, got {show(entries)}")
        if len(entries) > MAX_PRIORITY_BANDS:
            raise FlowConfigError(f"{where}: priorityBands has {len(entries)} entries (at most {MAX_PRIORITY_BANDS})")
        for i, entry in enumerate(entries):
            band = _band(entry, template, policy_plugins, params, f"{where}: priorityBands[{i}]", show,
                         needs_priority=True)
            if band.priority in bands:
                raise FlowConfigError(f"{where}: priorityBands[{i}]: priority {band.priority} is named twice")
            bands[band.priority] = band
    return FlowControlConfig(enabled=enabled, max_requests=max_requests, max_bytes=max_bytes, default_ttl_s=ttl,
                             default_band=template, bands=bands)


def _fields(spec: Any, allowed: set[str], where: str, show) -> None:
    if not isinstance(spec, Mapping):
        raise FlowConfigError(f"{where}: expected a mapping with {', '.join(sorted(allowed))}, got {show(spec)}")
    extra = [k for k in spec if k not in allowed]
    if extra:
        raise FlowConfigError(f"{where}: unknown field(s) {', '.join(sorted(show(k) for k in extra))}")


def _quantity(spec: Mapping, key: str, default: int, where: str, show) -> int:
    if key not in spec:
        return default
    value = spec[key]
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise FlowConfigError(f"{where}: {key} must be a quantity (e.g. 5000, 1Gi), got {show(value)}")
    try:
        number = parse_quantity(value if isinstance(value, int) else value.strip()[:80])
    except (ValueError, InvalidOperation, TypeError):
        raise FlowConfigError(f"{where}: {key} must be a quantity (e.g. 5000, 1Gi), got {show(value)}") from None
    if not isinstance(number, Decimal) or not number.is_finite() or number != number.to_integral_value() \
            or not 0 < number <= MAX_LIMIT:
        raise FlowConfigError(f"{where}: {key} must be a positive whole quantity of at most {MAX_LIMIT}, "
                              f"got {show(value)}")
    return int(number)


def _policy(spec: Mapping, key: str, kinds: set[str], default: str, policy_plugins: Mapping[str, str], where: str,
            show) -> str:
    if key not in spec:
        return default
    ref = spec[key]
    kind = policy_plugins.get(ref) if isinstance(ref, str) else None
    if kind is None and isinstance(ref, str) and ref in kinds:
        kind = ref  # upstream's built-in policy, named by its type without a plugins entry
    if kind not in kinds:
        raise FlowConfigError(f"{where}: {key} {show(ref)} names no {' or '.join(sorted(kinds))} plugin")
    return kind


def _policy_parameters(policy_plugins: Mapping[str, str], parameters: Mapping[str, Any], where: str,
                       show) -> dict[str, float]:
    """name → msPerPromptToken of each shortest-prompt-first plugin (its default when it has no parameters)."""
    out = {}
    for name, kind in policy_plugins.items():
        if kind != SPF:
            continue
        spec = parameters.get(name)
        if spec is None:
            out[name] = DEFAULT_MS_PER_PROMPT_TOKEN
            continue
        _fields(spec, {"msPerPromptToken"}, f"{where}: plugins ({name}) parameters", show)
        value = spec.get("msPerPromptToken", DEFAULT_MS_PER_PROMPT_TOKEN)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not 0 <= value <= MAX_MS_PER_PROMPT_TOKEN:
            raise FlowConfigError(f"{where}: plugins ({name}): msPerPromptToken must be a number from 0 to "
                                  f"{MAX_MS_PER_PROMPT_TOKEN:g}, got {show(value)}")
        out[name] = float(value)
    return out


def _band(spec: Any, template: BandConfig, policy_plugins: Mapping[str, str], params: Mapping[str, float],
          where: str, show, needs_priority: bool) -> BandConfig:
    allowed = {"maxRequests", "maxBytes", "fairnessPolicyRef", "orderingPolicyRef"}
    _fields(spec, allowed | ({"priority"} if needs_priority else set()), where, show)
    priority = 0
    if needs_priority:
        priority = spec.get("priority")
        if isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) > 1 << 31:
            raise FlowConfigError(f"{where}: priority must be an integer, got {show(priority)}")
    ordering = _policy(spec, "orderingPolicyRef", ORDERING_POLICIES, template.ordering, policy_plugins, where, show)
    ms_per_token = template.ms_per_prompt_token
    if "orderingPolicyRef" in spec:  # a declared plugin's parameters, or the default for the bare type name
        ms_per_token = params.get(spec["orderingPolicyRef"], DEFAULT_MS_PER_PROMPT_TOKEN)
    return BandConfig(priority=priority,
                      max_requests=_quantity(spec, "maxRequests", template.max_requests, where, show),
                      max_bytes=_quantity(spec, "maxBytes", template.max_bytes, where, show),
                      fairness=_policy(spec, "fairnessPolicyRef", FAIRNESS_POLICIES, template.fairness,
                                       policy_plugins, where, show),
                      ordering=ordering, ms_per_prompt_token=ms_per_token)
