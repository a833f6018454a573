"""Property-based fuzzing of EndpointPickerConfig text: `parse_config` (what `kvgate epp --config-file/--config-text`
and the operator's check of a pool's `kvgate.dev/epp-config` ConfigMap run) and the real `kvgate epp` process.

Configs are built as data — every plugin type, unknown ones, duplicate names, missing refs, parameters and
weights of every type and size, odd top-level sections and keys — then written as YAML and often mangled:
truncated, binary junk inserted, deep nesting, alias bombs (plain and through merge keys), recursive aliases,
several documents, non-mapping documents, huge texts. Every case must end in an EppConfig whose scheduler makes
a decision, or a one-line ConfigError — never another exception, and within a time bound (no case may stall).
"""

import subprocess
import time
import tracemalloc

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.epp.scheduling.config import API_VERSIONS, KIND, MAX_MESSAGE, ConfigError, EppConfig, parse_config
from kvgate.epp.scheduling.framework import CycleState, Scheduler
from kvgate.epp.scheduling.plugins import REGISTRY
from tests.epp.helpers import request, state
from tests.procs import KVGATE

MAX_EXAMPLES = 400  # ~10 s on a shared core
CASE_LIMIT_S = 5.0  # the slowest case measured ~0.6 s on a shared core (a 1 MiB text is refused before parsing)

ABSURD = st.sampled_from([0, -1, 1, 2, 0.5, -0.0, 2**31, 2**63, 10**400, -(10**400), 1e308, float("inf"),
                          float("-inf"), float("nan"), True, False, None, "", "1", "2s", "-2s", "1e999s", "nan",
                          "9" * 500, [], {}, [1], {"a": 1}])
scalars = st.one_of(ABSURD, st.integers(), st.floats(), st.text(max_size=20), st.booleans(), st.none())
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)
keys = st.one_of(st.text(max_size=12), st.integers(), st.booleans(), st.none())  # YAML keys need not be strings

TYPES = sorted(REGISTRY) + ["destination-endpoint-served-verifier", "no-such-plugin", ""]
NAMES = ["a", "b", "queue-scorer", "max-score-picker", "prefix-cache-scorer", "x" * 300]
PARAMS = ["blockSize", "blockSizeTokens", "maxPrefixBlocksToMatch", "maxPrefixTokensToMatch",
          "lruCapacityPerServer", "autoTune", "indexMaxBytes", "maxNumOfEndpoints"]

parameters = st.one_of(st.none(), values, st.dictionaries(
    st.one_of(st.sampled_from(PARAMS), keys), st.one_of(ABSURD, st.integers(-5, 5), values), max_size=3))
plugin_specs = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(TYPES)},
                          optional={"name": st.one_of(st.sampled_from(NAMES), scalars), "parameters": parameters,
                                    "extra": values}),
    values)
refs = st.one_of(
    st.fixed_dictionaries({"pluginRef": st.one_of(st.sampled_from(NAMES + sorted(REGISTRY)), values)},
                          optional={"weight": st.one_of(ABSURD, st.integers(0, 10), st.floats(), values),
                                    "extra": values}),
    values)
profiles = st.one_of(
    st.lists(st.fixed_dictionaries({"name": st.one_of(st.sampled_from(["default", "p", ""]), scalars)},
                                   optional={"plugins": st.one_of(st.lists(refs, max_size=5), values)}),
             max_size=3),
    values)
saturation = st.one_of(values, st.fixed_dictionaries({}, optional={
    "queueDepthThreshold": st.one_of(ABSURD, st.integers()),
    "kvCacheUtilThreshold": st.one_of(ABSURD, st.floats()),
    "metricsStalenessThreshold": st.one_of(ABSURD, st.text(max_size=10), st.sampled_from(["50ms", "1m30s"])),
    "junk": values}))


SCHEDULING_TYPES = sorted(t for t in REGISTRY if t != "single-profile-handler")
good_params = {"prefix-cache-scorer": st.fixed_dictionaries({}, optional={
                   "blockSize": st.integers(1, 4096), "maxPrefixBlocksToMatch": st.integers(1, 10**6),
                   "lruCapacityPerServer": st.integers(1, 2**40), "autoTune": st.booleans(),
                   "indexMaxBytes": st.integers(64 * 1024, 2**40)}),
               "max-score-picker": st.fixed_dictionaries({}, optional={"maxNumOfEndpoints": st.integers(1, 2**40)})}


@st.composite
def near_valid_docs(draw) -> dict:
    """A config that loads, with at most one field replaced by something odd: the checks past the first."""
    types = draw(st.lists(st.sampled_from(SCHEDULING_TYPES), min_size=1, max_size=5))
    plugins = []
    for i, t in enumerate(types):
        spec = {"type": t, "name": f"{t}-{i}"}
        if t in good_params and draw(st.booleans()):
            spec["parameters"] = draw(good_params[t])
        plugins.append(spec)
    names = [p["name"] for p in plugins]
    pickers = [n for n, t in zip(names, types) if "picker" in t]
    chosen = [n for n in names if n not in pickers] + pickers[:1]
    doc = {"apiVersion": sorted(API_VERSIONS)[0], "kind": KIND, "plugins": plugins}
    if draw(st.booleans()):
        doc["schedulingProfiles"] = [{"name": "default", "plugins": [
            {"pluginRef": n, "weight": draw(st.one_of(st.integers(0, 10), st.floats(0, 1e6)))} for n in chosen]}]
    if draw(st.booleans()):
        doc["saturationDetector"] = {"queueDepthThreshold": draw(st.integers(1, 10**9)),
                                     "kvCacheUtilThreshold": draw(st.floats(0.01, 1)),
                                     "metricsStalenessThreshold": draw(st.sampled_from(["50ms", "2s", 1, "1m30s"]))}
    if draw(st.integers(0, 2)) == 0:  # one odd value somewhere
        target = draw(st.sampled_from(["plugin", "param", "weight", "saturation", "top"]))
        odd = draw(st.one_of(ABSURD, values))
        if target == "plugin":
            plugins[draw(st.integers(0, len(plugins) - 1))][draw(st.sampled_from(["type", "name", "parameters"]))] = odd
        elif target == "param":
            plugins[-1]["parameters"] = {draw(st.sampled_from(PARAMS)): odd}
        elif target == "weight" and "schedulingProfiles" in doc:
            doc["schedulingProfiles"][0]["plugins"][0]["weight"] = odd
        elif target == "saturation":
            doc["saturationDetector"] = {draw(st.sampled_from(
                ["queueDepthThreshold", "kvCacheUtilThreshold", "metricsStalenessThreshold"])): odd}
        else:
            doc[draw(keys)] = odd
    return doc


@st.composite
def wild_docs(draw) -> dict:
    doc = {"apiVersion": draw(st.one_of(st.sampled_from(sorted(API_VERSIONS)), st.sampled_from(sorted(API_VERSIONS)),
                                        scalars)),
           "kind": draw(st.one_of(st.just(KIND), st.just(KIND), scalars)),
           "plugins": draw(st.one_of(st.lists(plugin_specs, max_size=6), values))}
    if draw(st.booleans()):
        doc["schedulingProfiles"] = draw(profiles)
    if draw(st.booleans()):
        doc["saturationDetector"] = draw(saturation)
    for _ in range(draw(st.integers(0, 2))):
        doc[draw(st.one_of(st.sampled_from(["featureGates", "dataLayer", "parser"]), keys))] = draw(values)
    return doc


def _bomb(levels: int, merge: bool) -> str:
    """Billion laughs: each level names the previous nine times (as list items, or merged in by `<<`)."""
    lines = ["l0: &l0 {x: lol, y: lol}" if merge else "l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, levels + 1):
        prev = ", ".join([f"*l{i - 1}"] * 9)
        lines.append(f"l{i}: &l{i} {{<<: [{prev}], k{i}: 1}}" if merge else f"l{i}: &l{i} [{prev}]")
    return "\n".join(lines) + "\n"


@st.composite
def config_texts(draw) -> str:
    doc = draw(st.one_of(near_valid_docs(), wild_docs()))
    text = yaml.safe_dump(doc, sort_keys=False, allow_unicode=draw(st.booleans()))
    mutation = draw(st.sampled_from(["none"] * 10 + ["truncate", "junk", "binary", "nest", "bomb",
                                     "recursive", "documents", "not-a-mapping", "huge", "anchors"]))
    if mutation == "truncate" and len(text) > 1:
        text = text[:draw(st.integers(1, len(text) - 1))]
    elif mutation == "junk":
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.text(max_size=20)) + text[at:]
    elif mutation == "binary":
        text = draw(st.binary(max_size=200)).decode("latin-1")
    elif mutation == "nest":
        depth = draw(st.sampled_from([50, 1000, 100_000]))
        text += "dataLayer: " + "[" * depth + "]" * depth + "\n"
    elif mutation == "bomb":
        where = draw(st.sampled_from(["dataLayer: *l{n}\n", "plugins: *l{n}\n",
                                      "plugins:\n- type: queue-scorer\n  parameters: *l{n}\n",
                                      "kind: *l{n}\n"]))
        levels = draw(st.sampled_from([3, 9, 30]))
        text = _bomb(levels, draw(st.booleans())) + text + where.format(n=levels)  # a repeated key: the last wins
    elif mutation == "recursive":
        text += draw(st.sampled_from(["dataLayer: &r [*r]\n", "parser: &r {a: *r}\n"]))
    elif mutation == "documents":
        text = text + "---\n" + text
    elif mutation == "not-a-mapping":
        text = draw(st.sampled_from(["", "~", "[]", "- a\n- b\n", "42", "'text'", "!!binary aGk=", "!!python/none ''"]))
    elif mutation == "huge":
        text += "featureGates: [" + "x, " * draw(st.sampled_from([20_000, 600_000])) + "]\n"
    elif mutation == "anchors":  # a legitimate use: one parameter set shared by two plugins
        text = ("plugins:\n- {type: prefix-cache-scorer, name: p1, parameters: &shared {blockSize: 32}}\n"
                "- {type: prefix-cache-scorer, name: p2, parameters: *shared}\n"
                f"apiVersion: {sorted(API_VERSIONS)[0]}\nkind: {KIND}\n")
    return text


def _check_outcome(text: str, outcome) -> str:
    """'valid' or 'error' after checking what parse_config gave; fails on anything else."""
    if isinstance(outcome, ConfigError):
        message = str(outcome)
        assert message and "\n" not in message and len(message) <= MAX_MESSAGE, message[:300]
        return "error"
    assert isinstance(outcome, EppConfig), (text[:300], repr(outcome)[:300])
    scheduler = Scheduler(outcome.scheduler)  # a config that loads must schedule
    endpoints = [state("10.0.0.1:8000", queue=1), state("10.0.0.2:8000", kv=0.5)]
    req = request("a prompt long enough for a block or two " * 4)
    cycle = CycleState()
    picked = scheduler.schedule(req, endpoints, cycle)
    assert picked and all(e in endpoints for e in picked)
    scheduler.on_picked(req, picked[0], cycle)
    return "valid"


@pytest.mark.slow
def test_fuzzed_configs_load_or_fail_with_a_config_error():
    seen = {"cases": 0, "valid": 0, "error": 0, "slowest_s": 0.0}

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(text=config_texts())
    def check(text):
        start = time.monotonic()
        try:
            outcome = parse_config(text, source="fuzz")
        except ConfigError as exc:
            outcome = exc
        elapsed = time.monotonic() - start
        seen["slowest_s"] = max(seen["slowest_s"], elapsed)
        assert elapsed < CASE_LIMIT_S, (text[:300], elapsed)
        seen[_check_outcome(text, outcome)] += 1
        seen["cases"] += 1

    check()
    print(f"\nconfig fuzz: {seen['cases']} cases, {seen['valid']} valid, {seen['error']} ConfigErrors, "
          f"slowest {seen['slowest_s']:.3f} s")
    assert seen["cases"] >= MAX_EXAMPLES and seen["valid"] > 0 and seen["error"] > 0


# --- the defects the fuzzing found, each pinned ----------------------------------------------------------------

HEADER = f"apiVersion: {sorted(API_VERSIONS)[0]}\nkind: {KIND}\n"


@pytest.mark.parametrize("text,expected", [
    # each raised something other than a ConfigError before (RecursionError, TypeError, OverflowError)
    (HEADER + "plugins: [{type: queue-scorer}]\ndataLayer: " + "[" * 2000 + "]" * 2000, "nested deeper than 64"),
    (HEADER + "plugins: [{type: queue-scorer}]\n1: x\nfoo: y\n", "unknown top-level field(s) 1, foo"),
    (HEADER + "plugins: [{type: queue-scorer}]\nschedulingProfiles: [{name: d, plugins: [{pluginRef: [a]}]}]\n",
     "pluginRef ['a'] names no plugin"),
    (HEADER + "plugins: [{type: [x]}]\n", "type is required"),
    (f"apiVersion: []\nkind: {KIND}\nplugins: [{{type: queue-scorer}}]\n", "unsupported apiVersion []"),
    (HEADER + "plugins: [{type: queue-scorer}]\nschedulingProfiles: [{name: d, plugins: "
     "[{pluginRef: queue-scorer, weight: 1" + "0" * 400 + "}]}]\n", "must be <= 1000000"),
    (HEADER + "plugins: [{type: queue-scorer}]\nschedulingProfiles: [{name: d, plugins: "
     "[{pluginRef: queue-scorer, weight: .nan}]}]\n", "must be <= 1000000"),
    (HEADER + "plugins: [{type: queue-scorer}]\nsaturationDetector: {metricsStalenessThreshold: 1" + "0" * 400 + "}\n",
     "at most 31536000 s"),
    (HEADER + "plugins: [{type: queue-scorer}]\nsaturationDetector: {metricsStalenessThreshold: .inf}\n",
     "at most 31536000 s"),
    (HEADER + "plugins: [{type: queue-scorer}]\nsaturationDetector: {metricsStalenessThreshold: .nan}\n",
     "at most 31536000 s"),
    (HEADER + "plugins: [{type: max-score-picker, parameters: {1: 2, b: 3}}]\n", "unknown parameter(s) 1, b"),
    (HEADER + "plugins: [{type: max-score-picker, parameters: {maxNumOfEndpoints: " + "9" * 30 + "}}]\n",
     "must be <= 1099511627776"),
])
def test_config_defects_found_by_fuzzing_are_config_errors(text, expected):
    with pytest.raises(ConfigError) as refused:
        parse_config(text)
    assert expected in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("merge", [False, True])
def test_alias_bombs_are_refused_before_they_expand(merge):
    """Before: yaml.safe_load took 10 s (merge keys, 7 levels) and an error message quoting the value expanded it."""
    text = _bomb(9, merge) + HEADER + "plugins: [{type: queue-scorer}]\ndataLayer: *l9\nkind: *l9\n"
    tracemalloc.start()
    start = time.monotonic()
    try:
        with pytest.raises(ConfigError, match="more than 10000 nodes once its aliases are expanded"):
            parse_config(text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.monotonic() - start < 1.0 and peak < 5 << 20, peak


def test_long_values_are_quoted_short_and_yaml_errors_are_one_line():
    with pytest.raises(ConfigError) as refused:
        parse_config(HEADER.replace(KIND, "x" * 100_000) + "plugins: [{type: queue-scorer}]\n")
    assert len(str(refused.value)) < 300
    with pytest.raises(ConfigError) as refused:
        parse_config(HEADER + "plugins: [\n  {type: queue-scorer\n")
    assert "not valid YAML" in str(refused.value) and "\n" not in str(refused.value)


def test_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path):
    from kvgate.epp.scheduling.config import load_config

    path = tmp_path / "epp.yaml"
    path.write_bytes(b"\xff\xfe\x00junk")  # was a UnicodeDecodeError
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(path)


# --- through the real process -----------------------------------------------------------------------------------

@pytest.mark.processes
def test_kvgate_epp_refuses_fuzzed_invalid_configs_with_one_line(tmp_path):
    """A few invalid texts (one per kind of mangling) through `kvgate epp --config-text` (two by `--config-file`):
    exit status 1 and one line on stderr, no traceback, before any port is opened."""
    texts = [HEADER + "plugins: [{type: queue-scorer}]\ndataLayer: " + "[" * 5000 + "]" * 5000 + "\n",
             _bomb(9, True) + HEADER + "plugins: *l9\n",
             HEADER + "plugins: [{type: queue-scorer, parameters: {1: x}}]\n",
             HEADER + "plugins: [{type: queue-scorer}]\nsaturationDetector: {metricsStalenessThreshold: .nan}\n",
             HEADER + "plugins:\n  - {type: queue-scorer\n",
             "- not\n- a mapping\n"]
    ran = 0
    for i, text in enumerate(texts):
        path = tmp_path / f"c{i}.yaml"
        path.write_text(text)
        for how in (["--config-text", text],) + ((["--config-file", str(path)],) if i < 2 else ()):
            proc = subprocess.run([KVGATE, "epp", *how, "--endpoints", "127.0.0.1:9"], capture_output=True,
                                  text=True, timeout=60)
            lines = proc.stderr.strip().splitlines()
            assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("kvgate epp: "), proc.stderr[-2000:]
            assert "Traceback" not in proc.stderr and not proc.stdout
            ran += 1
    print(f"\nkvgate epp: {ran} invalid configs refused with one line each")
