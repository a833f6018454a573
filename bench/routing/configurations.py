"""The routing configurations `kvgate bench routing` compares, as data: what sits between the client and the same
sim replicas, with its EndpointPickerConfig, extra EPP flags and extra engine flags.

kinds:
- `round-robin`: Envoy's own round-robin over the replicas, no EPP (kvgate.common.envoy_config.render_round_robin);
- `epp`: kvgate's Envoy + `kvgate epp` with `epp_config`;
- `router`: an external router process (sglang-router, vllm-router) in front of the replicas, with its own
  `--policy cache_aware`; only when its program is installed (`pip install 'kvgate[bench]'`).

`kv_events`: the engines publish KV-cache events and the EPP subscribes (StackSpec.kv_events: each
engine binds its own loopback sockets, and the EPP gets one --kv-events-endpoint per engine).

A configuration whose plugins are not (yet) in kvgate.epp.scheduling.plugins.REGISTRY is skipped with a note,
so configurations for plugins still being written are listed here and come alive once those plugins land.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from kvgate.epp.flow_config import SPF
from kvgate.epp.scheduling.config import DEFAULT_CONFIG_YAML, KVGATE_PROFILE_YAML

SIM_MODEL = "sim-model"
# Every configuration's replicas: a GPU-like timing model, slowed so that prefill dominates (0.2 ms per prompt
# token not cached: a 2300-token prompt costs 0.46 s, its cached part nothing) and a KV cache that binds (8192
# tokens per replica; the multi-tenant prefixes are 26 400 tokens). Prefix-cache hits are free in the sim
# (engine/sim_runner.py charges only the tokens a step computes).
SIM_ENGINE_ARGS = ["--sim-prefill-ms-per-token", "0.2", "--sim-max-model-len", "8192",
                   "--kv-cache-memory", str(8192 * 131072)]  # 8192 tokens x the sim's 128 KiB per token
SIM_BYTES_PER_TOKEN = 131072


def sim_engine_args(kv_tokens: int, prefill_chunk: int = 0) -> list[str]:
    """SIM_ENGINE_ARGS with `kv_tokens` of KV per replica (a context no longer than the cache holds) and, when
    `prefill_chunk` > 0, prompts computed at most that many tokens a step."""
    return ["--sim-prefill-ms-per-token", "0.2", "--sim-max-model-len", str(min(8192, kv_tokens)),
            "--kv-cache-memory", str(kv_tokens * SIM_BYTES_PER_TOKEN)] + \
        (["--long-prefill-token-threshold", str(prefill_chunk)] if prefill_chunk else [])


def slow_replica_args(replicas: int, slow_replicas: int, slowdown: float, slow_kv_tokens: int = 0
                      ) -> Callable[[int, str], list[str]]:
    """StackSpec.engine_args_for: the last `slow_replicas` of `replicas` run `slowdown` times slower,
    with `slow_kv_tokens` of KV when > 0 (later flags win over SIM_ENGINE_ARGS'); a router that breaks ties towards
    its first worker meets a fast one."""
    def args_for(i: int, host: str) -> list[str]:
        if i < replicas - slow_replicas:
            return []
        return (["--sim-slowdown", f"{slowdown:g}"] if slowdown != 1.0 else []) + \
            (sim_engine_args(slow_kv_tokens) if slow_kv_tokens else [])
    return args_for


_HEADER = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"


def _config(plugins: list[tuple[str, float | None, dict | None]]) -> str:
    """An EndpointPickerConfig of one profile: (type, weight or None for a filter/picker, parameters)."""
    specs = [{"type": t, **({"parameters": p} if p else {})} for t, _, p in plugins]
    refs = [{"pluginRef": t, **({"weight": w} if w is not None else {})} for t, w, _ in plugins]
    return _HEADER + yaml.safe_dump({"plugins": specs, "schedulingProfiles": [{"name": "default", "plugins": refs}]},
                                    sort_keys=False)


def with_flow_control(profile_yaml: str, ordering: str, queue_depth: int = 2, kv_util: float = 0.95) -> str:
    """`profile_yaml` with flow control on: held in the EPP while every endpoint has `queue_depth` waiting requests
    or a KV cache `kv_util` full, leaving in `ordering` (a built-in ordering policy's type name)."""
    text = profile_yaml.replace("plugins:\n", "featureGates: [flowControl]\nplugins:\n", 1)
    return text + (f"saturationDetector: {{queueDepthThreshold: {queue_depth}, kvCacheUtilThreshold: {kv_util}}}\n"
                   f"flowControl:\n  defaultPriorityBand:\n    orderingPolicyRef: {ordering}\n")


@dataclass(frozen=True)
class RoutingConfig:
    name: str
    what: str
    kind: str  # round-robin | epp | router
    epp_config: str | None = None
    kv_events: bool = False  # engines publish KV-cache events, the EPP subscribes
    router_cmd: tuple[str, ...] = ()  # kind router: the program and its policy flags (worker URLs, port added)
    oracle: bool = False  # each request carries its endpoint from oracle.placement (a reference point, not a router)

    def plugin_types(self) -> set[str]:
        if not self.epp_config:
            return set()
        return {p["type"] for p in yaml.safe_load(self.epp_config).get("plugins", [])}


def without_scorer(profile_yaml: str, type_name: str) -> str:
    """`profile_yaml` (one profile) without the plugin `type_name`."""
    doc = yaml.safe_load(profile_yaml)
    doc["plugins"] = [p for p in doc["plugins"] if p["type"] != type_name]
    doc["schedulingProfiles"][0]["plugins"] = [r for r in doc["schedulingProfiles"][0]["plugins"]
                                               if r["pluginRef"] != type_name]
    return yaml.safe_dump(doc, sort_keys=False)


def replacing_scorer(profile_yaml: str, type_name: str, new_type: str, parameters: dict | None = None,
                     first: bool = False) -> str:
    """`profile_yaml` (one profile) with the plugin `type_name` replaced by `new_type` (with `parameters`), with its
    weight, in its place or, `first`, at the head of the profile (a filter too, it then runs before the others)."""
    doc = yaml.safe_load(profile_yaml)
    (plugin,) = [p for p in doc["plugins"] if p["type"] == type_name]
    plugin.clear()
    plugin.update({"type": new_type, **({"parameters": parameters} if parameters else {})})
    refs = doc["schedulingProfiles"][0]["plugins"]
    (ref,) = [r for r in refs if r["pluginRef"] == type_name]
    ref["pluginRef"] = new_type
    if first:
        refs.remove(ref)
        refs.insert(0, ref)
    return yaml.safe_dump(doc, sort_keys=False)


def with_parameters(profile_yaml: str, type_name: str, **parameters) -> str:
    """`profile_yaml` with these parameters set on the plugin `type_name`."""
    doc = yaml.safe_load(profile_yaml)
    (plugin,) = [p for p in doc["plugins"] if p["type"] == type_name]
    plugin["parameters"] = {**plugin.get("parameters", {}), **parameters}
    return yaml.safe_dump(doc, sort_keys=False)


CONFIGURATIONS = [
    RoutingConfig("round-robin", "Envoy's round-robin over the replicas, no EPP", "round-robin"),
    RoutingConfig("approximate", "kvgate EPP, upstream's default: queue 2, kv-cache 2, prefix-cache (approximate, "
                  "from its own routing history) 3", "epp", DEFAULT_CONFIG_YAML),
    RoutingConfig("token-aware", "kvgate EPP: approximate prefix 3, token-load (in-flight tokens) 2, queue 1",
                  "epp", _config([("prefix-cache-scorer", 3, None), ("token-load-scorer", 2, None),
                                  ("queue-scorer", 1, None), ("max-score-picker", None, None)])),
    RoutingConfig("precise", "kvgate EPP, llm-d's precise profile: precise-prefix-cache (engine KV events) 3, "
                  "kv-cache 2, queue 2", "epp",
                  _config([("precise-prefix-cache-scorer", 3, None), ("kv-cache-utilization-scorer", 2, None),
                           ("queue-scorer", 2, None), ("max-score-picker", None, None)]),
                  kv_events=True),
    RoutingConfig("affinity", "kvgate EPP, llm-d's newest guide: prefix-cache-affinity filter, then precise "
                  "prefix 3, token-load 2, no-hit-lru 1", "epp",
                  _config([("prefix-cache-affinity-filter", None, None), ("precise-prefix-cache-scorer", 3, None),
                           ("token-load-scorer", 2, None), ("no-hit-lru-scorer", 1, None),
                           ("max-score-picker", None, None)]),
                  kv_events=True),
    RoutingConfig("kvgate", "kvgate's profile for kvgate engines (epp/scheduling/config.py KVGATE_PROFILE_YAML): "
                  "prefix-cache-affinity filter on the exact prefill backlog (loadTolerance 4, no exploration; a prefix past "
                  "1.25 replicas' share of the traffic spills to a second replica where a copy fits), "
                  "then precise prefix 3, prefix-group balance 3 (where the group's footprint fits), predicted latency "
                  "1 (each engine's own model), prefill-interference 6; loads in seconds of prefill", "epp",
                  KVGATE_PROFILE_YAML, kv_events=True),
    # the profile with token-load as its load term in place of the engines' latency model: what that model adds
    RoutingConfig("kvgate-token-load", "kvgate's profile with token-load in seconds where predicted-latency is",
                  "epp",
                  replacing_scorer(KVGATE_PROFILE_YAML, "predicted-latency-scorer", "token-load-scorer",
                                   {"loadUnit": "seconds"}), kv_events=True),
    RoutingConfig("kvgate-spf", "kvgate's profile + flow control: requests wait in the EPP while every replica has 2 "
                  "waiting (or its KV cache 95% full) and leave shortest prompt first, aged 2 ms per prompt token "
                  "(epp/flow_config.py)", "epp", with_flow_control(KVGATE_PROFILE_YAML, SPF),
                  kv_events=True),
    # the profile without prefill-interference: what that scorer adds
    RoutingConfig("kvgate-no-interference", "kvgate's profile without prefill-interference", "epp",
                  without_scorer(KVGATE_PROFILE_YAML, "prefill-interference-scorer"), kv_events=True),
    # the group balance's keepHomeBelow, off in the profile: `kvgate bench routing --configs kvgate,kvgate-sticky`
    # compares it per shape (docs/benchmarks.md)
    RoutingConfig("kvgate-sticky", "kvgate's profile with the group balance keeping a group whose prefix its home "
                  "evicted at that home (keepHomeBelow 0.5)", "epp",
                  with_parameters(KVGATE_PROFILE_YAML, "prefix-group-balance-scorer", keepHomeBelow=0.5),
                  kv_events=True),
    # the profile without the group balance's fit check: what that check adds
    RoutingConfig("kvgate-no-fit", "kvgate's profile without the group balance's fit check (fitKvCapacity 0)", "epp",
                  with_parameters(KVGATE_PROFILE_YAML, "prefix-group-balance-scorer", fitKvCapacity=0),
                  kv_events=True),
    # the latency model learned by the EPP from the responses it streams, as the profile's load term (docs/
    # benchmarks.md: the model alone spreads tenants; here the cache-keeping scorers stay); streaming the responses
    # through the EPP costs the gateway tier CPU per request (`--gateway-cpus 0` reports it)
    RoutingConfig("kvgate-learned", "kvgate's profile with predicted-latency learned by the EPP from the streamed "
                  "responses (learnFrom: responses; its objectives filter on, first)", "epp",
                  replacing_scorer(KVGATE_PROFILE_YAML, "predicted-latency-scorer", "predicted-latency-scorer",
                                   {"objectivesFilter": True}, first=True),
                  kv_events=True),
    # kvgate's profile with the objectives filter on: the engines' models (no response body through the EPP)
    RoutingConfig("kvgate-learned-engines", "kvgate's profile with predicted-latency's objectives filter on, first "
                  "(each engine's own model, learnFrom: engines)", "epp",
                  replacing_scorer(KVGATE_PROFILE_YAML, "predicted-latency-scorer", "predicted-latency-scorer",
                                   {"objectivesFilter": True, "learnFrom": "engines"}, first=True),
                  kv_events=True),
    # kvgate's profile, the responses streamed through the EPP only to measure its predictions from the engines' models
    # (the report's prediction-error distribution; costs the gateway tier what learning from responses does)
    RoutingConfig("kvgate-engines-measured", "kvgate's profile with the EPP measuring its predictions from the "
                  "engines' latency models against the streamed responses (measureError)", "epp",
                  with_parameters(KVGATE_PROFILE_YAML, "predicted-latency-scorer", measureError=True),
                  kv_events=True),
    # the affinity filter's loadTolerance below the profile's 4: `kvgate bench routing --shapes tuning --configs
    # kvgate,kvgate-tol1,kvgate-tol2` compares them (docs/benchmarks.md)
    *(RoutingConfig(f"kvgate-tol{t:g}", f"kvgate's profile with the affinity filter's loadTolerance {t:g}", "epp",
                    with_parameters(KVGATE_PROFILE_YAML, "prefix-cache-affinity-filter", loadTolerance=t),
                    kv_events=True) for t in (1, 2)),
    # the profile without the affinity filter's spill (docs/benchmarks.md): a hot prefix kept on its warm replicas
    # however large its share of the traffic
    RoutingConfig("kvgate-no-spill", "kvgate's profile without the affinity filter's spill (spillShare 0)", "epp",
                  with_parameters(KVGATE_PROFILE_YAML, "prefix-cache-affinity-filter", spillShare=0),
                  kv_events=True),
    # the spill without its fit test: a spill onto a replica whose cache has no room for the copy evicts what that
    # replica serves (hot-tenant, whose caches are oversubscribed); where caches have room it evens the load
    RoutingConfig("kvgate-spill-anywhere", "kvgate's profile with the spill's fit test off (spillFit false): a spill "
                  "goes to the least loaded cold replica whatever its cache holds", "epp",
                  with_parameters(KVGATE_PROFILE_YAML, "prefix-cache-affinity-filter", spillFit=False),
                  kv_events=True),
    # the spill decided from the engines' latency models instead of a share threshold (secondHome latency): a second
    # home for a busy prefix where a cold start there, plus the delay it puts on that endpoint's requests and the
    # cache it evicts, costs less than the wait at home saves this request and the prefix's next ones
    RoutingConfig("kvgate-second-home", "kvgate's profile with the affinity filter's second home decided from the "
                  "engines' latency models (secondHome latency) in place of the share spill", "epp",
                  with_parameters(KVGATE_PROFILE_YAML, "prefix-cache-affinity-filter", secondHome="latency"),
                  kv_events=True),
    # the group balance counting a homeless request's group where it is recorded (evictionAware): a group its home
    # evicted goes to the least loaded endpoint, not back to the home that could not keep it
    RoutingConfig("kvgate-evict-aware", "kvgate's profile with the group balance eviction-aware (evictionAware): a "
                  "group whose prefix no cache holds counts at its old home like any group there", "epp",
                  with_parameters(KVGATE_PROFILE_YAML, "prefix-group-balance-scorer", evictionAware=True),
                  kv_events=True),
    RoutingConfig("oracle-placement", "a reference point, not a router: each prefix group fixed to one replica for "
                  "the whole cell, ranked by its request count (known in advance) and dealt out in a snake, sent "
                  "through the EPP's header-based-testing-filter (bench/routing/oracle.py)", "epp",
                  _config([("header-based-testing-filter", None, None), ("max-score-picker", None, None)]),
                  oracle=True),
    # kvgate's profile with the approximate prefix scorer in place of the precise one, no KV events: what precise
    # prefix information is worth with the rest of the profile unchanged
    RoutingConfig("kvgate-approximate", "kvgate's profile with the approximate prefix-cache scorer (its own routing "
                  "history) instead of the precise one: no KV events", "epp",
                  KVGATE_PROFILE_YAML.replace("precise-prefix-cache-scorer", "prefix-cache-scorer")),
    RoutingConfig("predicted-ttft", "kvgate EPP: predicted-TTFT (backlog + uncached tokens / prefill rate) 3 on "
                  "the precise prefix match 1", "epp",
                  _config([("precise-prefix-cache-scorer", 1, None), ("predicted-ttft-scorer", 3, None),
                           ("max-score-picker", None, None)]),
                  kv_events=True),
    RoutingConfig("predicted-latency", "kvgate EPP: predicted-latency (TTFT learned online from the pool's "
                  "streamed responses) 3 on the precise prefix match 1", "epp",
                  _config([("precise-prefix-cache-scorer", 1, None), ("predicted-latency-scorer", 3, None),
                           ("max-score-picker", None, None)]),
                  kv_events=True),
    # the same with the model held at its prior (the analytic TTFT model): what learning adds
    RoutingConfig("predicted-latency-fixed", "predicted-latency with learning off (learn: false): the analytic "
                  "model, its errors still measured", "epp",
                  _config([("precise-prefix-cache-scorer", 1, None),
                           ("predicted-latency-scorer", 3, {"learn": False}), ("max-score-picker", None, None)]),
                  kv_events=True),
    RoutingConfig("sglang-router", "sglang-router --policy cache_aware over the replicas", "router",
                  router_cmd=("sglang-router", "launch", "--policy", "cache_aware")),
    RoutingConfig("vllm-router", "vllm-router --policy cache_aware over the replicas", "router",
                  router_cmd=("vllm-router", "--policy", "cache_aware")),
]
BY_NAME = {c.name: c for c in CONFIGURATIONS}
EXTERNAL_ROUTERS = tuple(c.name for c in CONFIGURATIONS if c.kind == "router")


def router_program(name: str) -> str | None:
    """An installed router program: beside this Python first (a venv's scripts), then on PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


def unavailable(config: RoutingConfig) -> str | None:
    """Why `config` cannot run here (None: it can)."""
    from kvgate.epp.scheduling.plugins import REGISTRY

    missing = sorted(config.plugin_types() - set(REGISTRY))
    if missing:
        return f"waits for plugin(s) not in this build: {', '.join(missing)}"
    if config.kind == "router" and router_program(config.router_cmd[0]) is None:
        return f"{config.router_cmd[0]} is not installed (pip install 'kvgate[bench]')"
    return None

