"""EndpointPickerConfig: upstream's YAML for the EPP's plugins, scheduling profiles and saturation detector.

    apiVersion: inference.networking.x-k8s.io/v1alpha1
    kind: EndpointPickerConfig
    plugins:                          # instances: type (registry name), name (defaults to type), parameters
    - type: prefix-cache-scorer
      parameters: {blockSize: 64, maxPrefixBlocksToMatch: 256, lruCapacityPerServer: 31250}
    - type: queue-scorer
    - type: max-score-picker
    schedulingProfiles:               # one: it runs every request
    - name: default
      plugins:
      - pluginRef: queue-scorer
        weight: 2                     # scorers only; default 1
      - pluginRef: prefix-cache-scorer
        weight: 3
    saturationDetector: {queueDepthThreshold: 5, kvCacheUtilThreshold: 0.8, metricsStalenessThreshold: 2s}

Defaults as upstream fills them: no schedulingProfiles → one `default` profile with every scheduling plugin;
a profile without a picker gets a max-score-picker.
Each profile links the data its plugins read to the plugins that produce it (scheduling/data.py): plugins that weigh
cache hits against load read the prefix match of the prefix scorer their `prefixScorer` parameter names, else of the
profile's only one; a plugin that needs data no plugin of its profile produces is refused here.
`featureGates: [flowControl]` with a `flowControl` section turns on flow control (epp/flow_config.py; its
fairness and ordering policies are plugins in `plugins:` that no profile lists). Other top-level sections upstream
knows (other featureGates, dataLayer, parser, requestHandler) are accepted and ignored. More than one profile is refused, as
upstream refuses it without a profile handler that runs several: kvgate's only handler is upstream's
single-profile-handler, so a second profile would be parsed and never run.

Any text at all gives an EppConfig or a one-line ConfigError (the operator puts it in a status condition, `kvgate
epp` prints it and exits 1): the YAML is read within kvgate.common.bounded_yaml's limits (1 Mi characters, a file 1 MiB,
64 levels, 10000 nodes with aliases expanded — a config from a tenant's ConfigMap cannot stall or bloat the
operator), and values are quoted at most 80 characters long in messages. tests/epp/test_fuzz_config.py fuzzes it.
"""

from __future__ import annotations

import math
import re
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvgate.common import bounded_file, bounded_yaml
from kvgate.common.envoy_config import RESPONSE_BODY, RESPONSE_HEADERS, RESPONSE_NONE
from kvgate.epp.flow_config import POLICY_TYPES, FlowConfigError, FlowControlConfig, parse_flow_control
from kvgate.epp.scheduling.framework import (
    Filter,
    Picker,
    Plugin,
    ProfileHandler,
    SchedulerConfig,
    SchedulingProfile,
    Scorer,
    WeightedScorer,
    needs_response_body,
)
from kvgate.epp.scheduling.plugins import REGISTRY, create_plugin

API_VERSIONS = {
    "inference.networking.x-k8s.io/v1alpha1",
    "config.apix.gateway-api-inference-extension.sigs.k8s.io/v1alpha1",
    "llm-d.ai/v1alpha1",
    "llm-d.ai/v1",
}
KIND = "EndpointPickerConfig"
# Response-side plugins (not scheduling plugins: they go in no profile). Upstream's conformance hook: copy the
# endpoint the gateway reports as served (response metadata) into the `x-conformance-test-served-endpoint`
# response header, so a test client can see where its request really went.
SERVED_VERIFIER = "destination-endpoint-served-verifier"
RESPONSE_PLUGIN_TYPES = {SERVED_VERIFIER}
MAX_MESSAGE = 2000  # characters of a ConfigError (a Kubernetes condition message may have 32768)
MAX_WEIGHT = 1_000_000  # scores are in [0, 1]: a larger weight only loses float precision for the others
IGNORED_SECTIONS = {"dataLayer", "parser", "requestHandler", "data"}
KNOWN_SECTIONS = {"apiVersion", "kind", "plugins", "schedulingProfiles", "saturationDetector", "featureGates",
                  "flowControl"} | IGNORED_SECTIONS


class ConfigError(ValueError):
    """An EndpointPickerConfig that cannot be used; the message (one line) names the problem and where it is."""

    def __init__(self, message: str) -> None:
        message = message.replace("\r", "\\r").replace("\n", "\\n")
        super().__init__(message if len(message) <= MAX_MESSAGE else message[:MAX_MESSAGE - 3] + "...")


_short = reprlib.Repr()
_short.maxstring = _short.maxother = 80
_short.maxlevel = 3


def show(value: Any) -> str:
    """`value` quoted for a message: its repr, cut short (a value may be a megabyte, or a thousand levels)."""
    return _short.repr(value)


def _names(keys: Any) -> str:
    """Field names for a message, sorted as text (YAML keys may be numbers, booleans or null)."""
    return ", ".join(sorted(k[:80] if isinstance(k, str) else show(k) for k in keys))


@dataclass
class SaturationConfig:
    queue_depth_threshold: int = 5
    kv_cache_util_threshold: float = 0.8
    metrics_staleness_threshold: float | None = None  # seconds; None = the --metrics-staleness-threshold flag


@dataclass
class EppConfig:
    scheduler: SchedulerConfig
    saturation: SaturationConfig = field(default_factory=SaturationConfig)
    report_served_endpoint: bool = False  # a destination-endpoint-served-verifier is configured
    flow_control: FlowControlConfig = field(default_factory=FlowControlConfig)

    @property
    def returns_lists(self) -> bool:
        """The primary profile's picker answers with fallbacks (maxNumOfEndpoints > 1): a gateway that follows
        them (kvgate's override_host route) can retry a failed endpoint on the next; ORIGINAL_DST cannot."""
        picker = self.scheduler.profiles[0].picker
        return picker is not None and picker.max_endpoints != 1

    @property
    def needs_response_body(self) -> bool:
        """A configured plugin learns from response bodies (first-token times, usage): a gateway must stream them
        through the EPP. Otherwise a gateway that can choose (kvgate's: PoolBackend.response_body) leaves them out
        of the EPP's path — the response headers and the stream's end are all the EPP's release needs."""
        return needs_response_body(self.scheduler)

    @property
    def response_needs(self) -> str:
        """What of a response this config reads (envoy_config.RESPONSE_NEEDS): the body where a plugin learns from
        it, the headers where the served-endpoint verifier reports from them, else nothing — the ext-proc stream's
        end is all the EPP's release needs."""
        if self.needs_response_body:
            return RESPONSE_BODY
        return RESPONSE_HEADERS if self.report_served_endpoint else RESPONSE_NONE


# Upstream's default: queue 2, kv-cache 2, prefix 3, and a max-score picker returning one endpoint — all that a
# stock ORIGINAL_DST cluster can follow. No conformance plugins: a client cannot steer its request, and responses
# carry nothing but what the model server sent (the conformance suite passes its own config).
DEFAULT_CONFIG_YAML = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
  - pluginRef: max-score-picker
"""


# The default's scorers with a picker that also returns two fallbacks: for a gateway that follows them (kvgate's
# own Envoy: override_host with retries), a request the primary cannot take — it died, it is draining — is
# retried on the next. `kvgate up` runs it (`kvgate bench chaos`: replica-kill vs replica-kill-default).
def with_fallbacks(config_yaml: str) -> str:
    """`config_yaml` with its max-score picker also returning two fallbacks (maxNumOfEndpoints 3)."""
    return config_yaml.replace("- type: max-score-picker\n",
                               "- type: max-score-picker\n  parameters: {maxNumOfEndpoints: 3}\n", 1)


FALLBACK_CONFIG_YAML = with_fallbacks(DEFAULT_CONFIG_YAML)


def default_config() -> EppConfig:
    """Upstream's default: queue 2, kv-cache 2, prefix 3, max-score picker returning one endpoint."""
    return parse_config(DEFAULT_CONFIG_YAML)


def load_config(path: str | Path | None, text: str | None = None) -> EppConfig:
    """The config in `path` (`--config-file`), else `text` (`--config-text`), else the default."""
    if text:
        return parse_config(text, source="--config-text")
    if path is None or str(path) == "":
        return default_config()
    try:
        text = bounded_file.read_text(path, bounded_yaml.MAX_CHARS)  # a regular file of at most 1 MiB
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text: {e.reason} at byte {e.start}") from e
    except bounded_file.FileLimitError as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from e
    return parse_config(text, source=str(path))


def parse_config(text: str, source: str = "<config>") -> EppConfig:
    if not isinstance(text, str):
        raise ConfigError(f"{source}: expected YAML text, got {type(text).__name__}")
    try:
        doc = bounded_yaml.load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {' '.join(str(e).split())[:500]}") from e
    if not isinstance(doc, Mapping):
        raise ConfigError(f"{source}: expected a mapping (an EndpointPickerConfig), got {type(doc).__name__}")
    _check_header(doc, source)
    specs, response_plugins, policy_plugins = doc.get("plugins"), [], []
    if isinstance(specs, list):
        def typed(p, kinds) -> bool:
            return isinstance(p, Mapping) and isinstance(p.get("type"), str) and p["type"] in kinds
        response_plugins = [p for p in specs if typed(p, RESPONSE_PLUGIN_TYPES)]
        policy_plugins = [p for p in specs if typed(p, POLICY_TYPES)]
        specs = [p for p in specs if not typed(p, RESPONSE_PLUGIN_TYPES | POLICY_TYPES)]
    for spec in response_plugins + policy_plugins:
        _check_fields(spec, {"type", "name", "parameters"}, f"{source}: plugins ({spec['type']})")
    plugins = _build_plugins(specs, source)
    profiles = _build_profiles(doc.get("schedulingProfiles"), plugins, source)
    saturation = _saturation(doc.get("saturationDetector"), source)
    policies, policy_parameters = {}, {}
    for spec in policy_plugins:
        name = spec.get("name") or spec["type"]
        if not isinstance(name, str) or name in policies or name in plugins:
            raise ConfigError(f"{source}: plugins: name {show(name)} is not a unique string")
        policies[name] = spec["type"]
        if spec.get("parameters") is not None:
            policy_parameters[name] = spec["parameters"]
    try:
        flow_control = parse_flow_control(doc.get("flowControl"), doc.get("featureGates"), policies, source,
                                          parse_duration, show, policy_parameters)
    except FlowConfigError as e:
        raise ConfigError(str(e)) from e
    return EppConfig(scheduler=SchedulerConfig(profiles=profiles, plugins=plugins), saturation=saturation,
                     report_served_endpoint=bool(response_plugins), flow_control=flow_control)


def _check_header(doc: Mapping, source: str) -> None:
    if doc.get("kind") != KIND:
        raise ConfigError(f"{source}: kind must be {KIND}, got {show(doc.get('kind'))}")
    if not isinstance(doc.get("apiVersion"), str) or doc["apiVersion"] not in API_VERSIONS:
        raise ConfigError(f"{source}: unsupported apiVersion {show(doc.get('apiVersion'))} "
                          f"(supported: {', '.join(sorted(API_VERSIONS))})")
    unknown = set(doc) - KNOWN_SECTIONS
    if unknown:
        raise ConfigError(f"{source}: unknown top-level field(s) {_names(unknown)}")


def _build_plugins(specs: Any, source: str) -> dict[str, Plugin]:
    if not isinstance(specs, list) or not specs:
        raise ConfigError(f"{source}: plugins must be a non-empty list")
    plugins: dict[str, Plugin] = {}
    for i, spec in enumerate(specs):
        where = f"{source}: plugins[{i}]"
        _check_fields(spec, {"type", "name", "parameters"}, where)
        type_name = spec.get("type")
        if not isinstance(type_name, str) or not type_name:
            raise ConfigError(f"{where}: type is required")
        if type_name not in REGISTRY:
            raise ConfigError(f"{where}: unknown plugin type {show(type_name)} (known: {', '.join(sorted({*REGISTRY, *RESPONSE_PLUGIN_TYPES, *POLICY_TYPES}))})")
        name = spec.get("name") or type_name
        if not isinstance(name, str):
            raise ConfigError(f"{where}: name must be a string")
        if name in plugins:
            raise ConfigError(f"{where}: duplicate plugin name {show(name)}")
        parameters = spec.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise ConfigError(f"{where} ({name}): parameters must be a mapping")
        try:
            plugins[name] = create_plugin(type_name, parameters, name)
        except ValueError as e:
            raise ConfigError(f"{where} ({name}): {e}") from e
    return plugins


def _build_profiles(specs: Any, plugins: dict[str, Plugin], source: str) -> list[SchedulingProfile]:
    if specs is None:  # upstream's default: one profile with every scheduling plugin, weight 1
        specs = [{"name": "default", "plugins": [{"pluginRef": n} for n, p in plugins.items()
                                                 if not isinstance(p, ProfileHandler)]}]
    if not isinstance(specs, list) or not specs:
        raise ConfigError(f"{source}: schedulingProfiles must be a non-empty list")
    if len(specs) > 1:  # a profile no handler runs would be parsed and silently ignored
        handlers = [n for n, p in plugins.items() if isinstance(p, ProfileHandler)]
        handler = f"{handlers[0]} (a single-profile handler)" if handlers else "the single-profile handler"
        raise ConfigError(f"{source}: {handler} runs one scheduling profile, got {len(specs)} (kvgate has no "
                          "multi-profile handler such as prefill/decode)")
    profiles = []
    for i, spec in enumerate(specs):
        where = f"{source}: schedulingProfiles[{i}]"
        if not isinstance(spec, Mapping):
            raise ConfigError(f"{where}: expected a mapping with name and plugins")
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}: name is required")
        profiles.append(_build_profile(name, spec.get("plugins"), plugins, f"{where} ({name})"))
    return profiles


def _build_profile(name: str, refs: Any, plugins: dict[str, Plugin], where: str) -> SchedulingProfile:
    if not isinstance(refs, list):
        raise ConfigError(f"{where}: plugins must be a list of {{pluginRef, weight}}")
    profile = SchedulingProfile(name=name)
    for j, ref in enumerate(refs):
        at = f"{where}: plugins[{j}]"
        if not isinstance(ref, Mapping) or "pluginRef" not in ref:
            raise ConfigError(f"{at}: expected a mapping with pluginRef")
        extra = set(ref) - {"pluginRef", "weight"}
        if extra:
            raise ConfigError(f"{at}: unknown field(s) {_names(extra)}")
        plugin_ref = ref["pluginRef"]
        plugin = plugins.get(plugin_ref) if isinstance(plugin_ref, str) else None
        if plugin is None:
            raise ConfigError(f"{at}: pluginRef {show(plugin_ref)} names no plugin "
                              f"(defined: {', '.join(plugins)})")
        weight = ref.get("weight", 1)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise ConfigError(f"{at}: weight of {show(plugin.name)} must be a number, got {show(weight)}")
        if weight < 0:
            raise ConfigError(f"{at}: weight of {show(plugin.name)} must be >= 0, got {show(weight)}")
        if not weight <= MAX_WEIGHT:  # NaN and inf too; a YAML int may be too large for a float
            raise ConfigError(f"{at}: weight of {show(plugin.name)} must be <= {MAX_WEIGHT}, got {show(weight)}")
        if isinstance(plugin, ProfileHandler):
            raise ConfigError(f"{at}: {show(plugin.name)} is a profile handler, not a scheduling plugin")
        placed = False
        if isinstance(plugin, Filter):
            profile.filters.append(plugin)
            placed = True
        if isinstance(plugin, Scorer):
            profile.scorers.append(WeightedScorer(plugin, float(weight)))
            placed = True
        if isinstance(plugin, Picker):
            if profile.picker is not None:
                raise ConfigError(f"{at}: more than one picker ({show(profile.picker.name)} and {show(plugin.name)})")
            profile.picker = plugin
            placed = True
        if not placed:
            raise ConfigError(f"{at}: {show(plugin.name)} is not a filter, scorer or picker")
    if profile.picker is None:
        profile.picker = create_plugin("max-score-picker")
    try:  # what each plugin reads comes from a producer of this profile; a missing or ambiguous one fails here
        profile.link()
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from e
    return profile


def _check_fields(spec: Any, allowed: set[str], where: str) -> None:
    """A mapping with no fields beyond `allowed`, else a ConfigError naming the place."""
    if not isinstance(spec, Mapping):
        raise ConfigError(f"{where}: expected a mapping with {', '.join(sorted(allowed))}")
    extra = set(spec) - allowed
    if extra:
        raise ConfigError(f"{where}: unknown field(s) {_names(extra)}")


def _saturation(spec: Any, source: str) -> SaturationConfig:
    config = SaturationConfig()
    if spec is None:
        return config
    where = f"{source}: saturationDetector"
    _check_fields(spec, {"queueDepthThreshold", "kvCacheUtilThreshold", "metricsStalenessThreshold"}, where)
    if "queueDepthThreshold" in spec:
        q = spec["queueDepthThreshold"]
        if isinstance(q, bool) or not isinstance(q, int) or q <= 0:
            raise ConfigError(f"{where}: queueDepthThreshold must be a positive integer, got {show(q)}")
        config.queue_depth_threshold = q
    if "kvCacheUtilThreshold" in spec:
        kv = spec["kvCacheUtilThreshold"]
        if isinstance(kv, bool) or not isinstance(kv, (int, float)) or not 0 < kv <= 1:
            raise ConfigError(f"{where}: kvCacheUtilThreshold must be a number in (0, 1], got {show(kv)}")
        config.kv_cache_util_threshold = float(kv)
    if "metricsStalenessThreshold" in spec:
        try:
            config.metrics_staleness_threshold = parse_duration(spec["metricsStalenessThreshold"])
        except ValueError as e:
            raise ConfigError(f"{where}: metricsStalenessThreshold: {e}") from e
    return config


MAX_DURATION_S = 365 * 24 * 3600.0  # a year: past it a duration is a typo (and asyncio's timeouts overflow)
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: Any) -> float:
    """Go-style duration ("50ms", "2s", "1m30s") or a plain number of seconds → seconds (> 0)."""
    if isinstance(value, bool):
        raise ValueError(f"not a duration: {show(value)}")
    if isinstance(value, (int, float)):
        seconds = float(value) if abs(value) <= MAX_DURATION_S else math.inf
    elif isinstance(value, str) and value.strip():
        text, pos, seconds = value.strip(), 0, 0.0
        for m in _DURATION_PART.finditer(text):
            if m.start() != pos:
                break
            seconds += float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
            pos = m.end()
        if pos != len(text):
            try:
                seconds, pos = float(text), len(text)
            except ValueError:
                raise ValueError(f"not a duration: {show(value)} (use e.g. 50ms, 2s)") from None
    else:
        raise ValueError(f"not a duration: {show(value)}")
    if not 0 < seconds <= MAX_DURATION_S:  # NaN and inf too
        raise ValueError(f"duration must be positive and at most {MAX_DURATION_S:.0f} s, got {show(value)}")
    return seconds


# kvgate's profile for pools of kvgate engines, which publish KV events and their exact prefill backlog (chosen by
# `kvgate bench routing`, multi-tenant workload; the numbers are in docs/benchmarks.md): stay on the
# endpoint that holds the prompt until its prefill backlog costs more than 4x what the hit saves (no random
# exploration: a needless spill evicts another prefix), score the exact cached prefix from KV events, give a
# prefix nobody holds to the endpoint serving the fewest prefix groups among those its footprint still fits
# (fitKvCapacity 1: a tenant is not given to a replica whose cache is full while another has room), put a long
# prefill where it holds up the fewest other requests (prefill-interference, weight 6: chosen on the tuning shapes
# and hot-tenant, where a hot tenant's replica otherwise takes other tenants' cold prompts), and break ties on the
# TTFT each engine's own latency model predicts (predicted-latency-scorer, learnFrom: engines — the model every
# kvgate engine fits from the requests it serves and publishes on /metrics; an engine that has not fitted 32 requests
# yet is predicted by the analytic model, and the EPP logs which per endpoint; `kvgate bench routing --shapes tuning
# --configs kvgate,kvgate-token-load` compares it with token-load in seconds). Loads in seconds (loadUnit): in a
# pool of mixed hardware each endpoint's load counts by how fast it prefills, as its engine times itself (kvgate
# bench routing --shapes mixed-hardware; a uniform pool routes exactly as in tokens).
# Needs the engines' KV events (`kvgate up --profile kvgate` turns them on; in Kubernetes, spec.engine.kvEvents).
# First, a Responses API request continuing a stored response goes to the engine that stored it
# (previous-response-affinity-filter; every other request passes it unchanged).
KVGATE_PROFILE_YAML = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: previous-response-affinity-filter
- type: prefix-cache-affinity-filter
  parameters: {loadSignal: backlog, loadTolerance: 4, explorationProbability: 0, loadUnit: seconds, spillShare: 1.25}
- type: precise-prefix-cache-scorer
- type: prefix-group-balance-scorer
  parameters: {balanceBy: tokens, fitKvCapacity: 1, loadUnit: seconds}
- type: predicted-latency-scorer
  parameters: {learnFrom: engines}
- type: prefill-interference-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: previous-response-affinity-filter
  - pluginRef: prefix-cache-affinity-filter
  - pluginRef: precise-prefix-cache-scorer
    weight: 3
  - pluginRef: prefix-group-balance-scorer
    weight: 3
  - pluginRef: predicted-latency-scorer
    weight: 1
  - pluginRef: prefill-interference-scorer
    weight: 6
  - pluginRef: max-score-picker
"""
KVGATE_PROFILE_FALLBACK_YAML = with_fallbacks(KVGATE_PROFILE_YAML)

