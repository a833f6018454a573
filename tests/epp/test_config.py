"""EndpointPickerConfig loading: the default, an upstream-style file, and every error a user can make."""

import pytest

from kvgate.conformance.epp_config import CONFORMANCE_EPP_CONFIG
from kvgate.epp.scheduling.config import ConfigError, default_config, load_config, parse_config, parse_duration
from kvgate.epp.scheduling.framework import Scheduler

HEADER = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"

FULL = HEADER + """\
plugins:
- type: single-profile-handler
- type: header-based-testing-filter
- type: prefix-cache-scorer
  parameters:
    blockSize: 32
    maxPrefixBlocksToMatch: 128
    lruCapacityPerServer: 5000
- name: queue
  type: queue-scorer
- type: kv-cache-utilization-scorer
- type: lora-affinity-scorer
- type: running-requests-size-scorer
- type: token-load-scorer
- type: weighted-random-picker
  parameters:
    maxNumOfEndpoints: 3
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: header-based-testing-filter
  - pluginRef: queue
    weight: 1.5
  - pluginRef: kv-cache-utilization-scorer
  - pluginRef: prefix-cache-scorer
    weight: 4
  - pluginRef: lora-affinity-scorer
    weight: 0
  - pluginRef: running-requests-size-scorer
  - pluginRef: token-load-scorer
  - pluginRef: weighted-random-picker
saturationDetector:
  queueDepthThreshold: 8
  kvCacheUtilThreshold: 0.9
  metricsStalenessThreshold: 500ms
featureGates: [dataLayer]
"""


def profile_summary(config):
    p = config.scheduler.profiles[0]
    return ([f.type_name for f in p.filters], [(ws.scorer.name, ws.weight) for ws in p.scorers], p.picker.type_name)


def test_default_config():
    config = default_config()
    assert profile_summary(config) == (
        [], [("queue-scorer", 2.0), ("kv-cache-utilization-scorer", 2.0), ("prefix-cache-scorer", 3.0)],
        "max-score-picker")
    # Upstream's default: one endpoint (all a stock ORIGINAL_DST cluster can parse), no conformance plugins.
    assert config.scheduler.profiles[0].picker.max_endpoints == 1
    assert not config.report_served_endpoint
    assert "header-based-testing-filter" not in config.scheduler.plugins
    assert load_config(None).scheduler.profiles[0].name == "default"
    s = config.saturation
    assert (s.queue_depth_threshold, s.kv_cache_util_threshold, s.metrics_staleness_threshold) == (5, 0.8, None)


def test_served_endpoint_verifier_is_a_response_plugin():
    assert not default_config().report_served_endpoint  # a conformance hook: only in configs that name it
    assert parse_config(CONFORMANCE_EPP_CONFIG).report_served_endpoint
    without = parse_config(HEADER + "plugins:\n- type: queue-scorer\n")
    assert not without.report_served_endpoint
    with_it = parse_config(HEADER + "plugins:\n- type: destination-endpoint-served-verifier\n- type: queue-scorer\n")
    assert with_it.report_served_endpoint and profile_summary(with_it)[1] == [("queue-scorer", 1.0)]
    with pytest.raises(ConfigError, match="unknown field"):
        parse_config(HEADER + "plugins:\n- type: destination-endpoint-served-verifier\n  weight: 2\n"
                              "- type: queue-scorer\n")
    with pytest.raises(ConfigError, match="names no plugin"):  # it is no scheduling plugin
        parse_config(HEADER + "plugins:\n- type: destination-endpoint-served-verifier\n- type: queue-scorer\n"
                              "schedulingProfiles:\n- name: p\n  plugins:\n"
                              "  - pluginRef: destination-endpoint-served-verifier\n")


def test_full_upstream_style_file(tmp_path):
    path = tmp_path / "epp.yaml"
    path.write_text(FULL)
    config = load_config(path)
    filters, scorers, picker = profile_summary(config)
    assert filters == ["header-based-testing-filter"]
    assert scorers == [("queue", 1.5), ("kv-cache-utilization-scorer", 1.0), ("prefix-cache-scorer", 4.0),
                       ("lora-affinity-scorer", 0.0), ("running-requests-size-scorer", 1.0),
                       ("token-load-scorer", 1.0)]
    assert picker == "weighted-random-picker"
    assert config.scheduler.profiles[0].picker.max_endpoints == 3
    prefix = config.scheduler.plugins["prefix-cache-scorer"]
    assert (prefix.block_size, prefix.max_prefix_blocks, prefix.index.capacity) == (32, 128, 5000)
    assert config.saturation.queue_depth_threshold == 8
    assert config.saturation.kv_cache_util_threshold == 0.9
    assert config.saturation.metrics_staleness_threshold == pytest.approx(0.5)
    Scheduler(config.scheduler)  # builds


def test_upstream_defaults_fill_profile_and_picker():
    config = parse_config(HEADER + "plugins:\n- type: queue-scorer\n- type: kv-cache-utilization-scorer\n")
    assert profile_summary(config) == (
        [], [("queue-scorer", 1.0), ("kv-cache-utilization-scorer", 1.0)], "max-score-picker")


@pytest.mark.parametrize("handler", ["", "{type: single-profile-handler}, "])
def test_a_second_profile_that_nothing_would_run_is_refused(handler):
    text = HEADER + f"""\
plugins: [{handler}{{type: queue-scorer}}, {{type: random-picker}}]
schedulingProfiles:
- {{name: prefill, plugins: [{{pluginRef: queue-scorer}}]}}
- {{name: decode, plugins: [{{pluginRef: random-picker}}]}}
"""
    with pytest.raises(ConfigError, match="runs one scheduling profile, got 2"):
        parse_config(text)
    one = parse_config(text.split("- {name: decode")[0])
    assert [p.name for p in one.scheduler.profiles] == ["prefill"]
    assert Scheduler(one.scheduler).primary.name == "prefill"


@pytest.mark.parametrize("text, message", [
    ("- just a list\n", "expected a mapping"),
    ("plugins: [oops\n", "not valid YAML"),
    ("apiVersion: v1\nkind: EndpointPickerConfig\nplugins: [{type: queue-scorer}]\n", "unsupported apiVersion"),
    ("apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: Pod\n", "kind must be EndpointPickerConfig"),
    (HEADER + "plugins: []\n", "plugins must be a non-empty list"),
    (HEADER + "plugins: [{type: queue-scorer}]\nschedulingProfile: []\n", "unknown top-level field"),
    (HEADER + "plugins: [{type: no-such-scorer}]\n", "unknown plugin type 'no-such-scorer'"),
    (HEADER + "plugins: [{name: x}]\n", "type is required"),
    (HEADER + "plugins: [{type: queue-scorer, weight: 2}]\n", "unknown field"),
    (HEADER + "plugins: [{type: queue-scorer}, {type: queue-scorer}]\n", "duplicate plugin name 'queue-scorer'"),
    (HEADER + "plugins: [{type: queue-scorer, parameters: {x: 1}}]\n", "unknown parameter"),
    (HEADER + "plugins: [{type: queue-scorer, parameters: [1]}]\n", "parameters must be a mapping"),
    (HEADER + "plugins: [{type: prefix-cache-scorer, parameters: {blockSize: 0}}]\n", "blockSize must be >= 1"),
    (HEADER + "plugins: [{type: queue-scorer}]\nschedulingProfiles:\n- {name: d, plugins: [{pluginRef: nope}]}\n",
     "pluginRef 'nope' names no plugin"),
    (HEADER + "plugins: [{type: queue-scorer}]\nschedulingProfiles:\n"
              "- {name: d, plugins: [{pluginRef: queue-scorer, weight: heavy}]}\n",
     "weight of 'queue-scorer' must be a number"),
    (HEADER + "plugins: [{type: queue-scorer}]\nschedulingProfiles:\n"
              "- {name: d, plugins: [{pluginRef: queue-scorer, weight: -1}]}\n", "must be >= 0"),
    (HEADER + "plugins: [{type: max-score-picker}, {type: random-picker}]\nschedulingProfiles:\n"
              "- {name: d, plugins: [{pluginRef: max-score-picker}, {pluginRef: random-picker}]}\n",
     "more than one picker"),
    (HEADER + "plugins: [{type: queue-scorer}]\nschedulingProfiles:\n- {plugins: []}\n", "name is required"),
    (HEADER + "plugins: [{type: single-profile-handler}, {type: queue-scorer}]\nschedulingProfiles:\n"
              "- {name: a, plugins: []}\n- {name: b, plugins: []}\n", "runs one scheduling profile"),
    (HEADER + "plugins: [{type: single-profile-handler}]\nschedulingProfiles:\n"
              "- {name: a, plugins: [{pluginRef: single-profile-handler}]}\n", "profile handler"),
    (HEADER + "plugins: [{type: queue-scorer}]\nsaturationDetector: {queueDepthThreshold: 0}\n",
     "queueDepthThreshold must be a positive integer"),
    (HEADER + "plugins: [{type: queue-scorer}]\nsaturationDetector: {kvCacheUtilThreshold: 1.5}\n",
     "kvCacheUtilThreshold must be a number in"),
    (HEADER + "plugins: [{type: queue-scorer}]\nsaturationDetector: {metricsStalenessThreshold: soon}\n",
     "not a duration"),
])
def test_errors_name_the_problem(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(text)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "absent.yaml")


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("value, seconds", [("50ms", 0.05), ("2s", 2.0), ("1m30s", 90.0), (3, 3.0), ("0.5", 0.5),
                                            ("250us", 0.00025)])
def test_parse_duration(value, seconds):
    assert parse_duration(value) == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["", "5 parsecs", "-1s", 0, True, None])
def test_parse_duration_rejects(value):
    with pytest.raises(ValueError):
        parse_duration(value)


def test_conformance_config_adds_only_the_test_plugins():
    conformance, default = parse_config(CONFORMANCE_EPP_CONFIG), default_config()
    filters, scorers, picker = profile_summary(conformance)
    assert filters == ["header-based-testing-filter"]
    assert (scorers, picker) == profile_summary(default)[1:]
    assert conformance.report_served_endpoint


def test_config_text_is_used_and_wins_over_nothing(tmp_path):
    text = HEADER + "plugins:\n- type: queue-scorer\n"
    assert profile_summary(load_config(None, text))[1] == [("queue-scorer", 1.0)]
    with pytest.raises(ConfigError, match="--config-text"):
        load_config(None, "kind: Nope\n")


def test_max_num_of_endpoints_defaults_to_one_and_must_be_positive():
    picker = parse_config(HEADER + "plugins:\n- type: random-picker\n").scheduler.profiles[0].picker
    assert picker.max_endpoints == 1
    three = parse_config(HEADER + "plugins:\n- type: max-score-picker\n  parameters: {maxNumOfEndpoints: 3}\n")
    assert three.scheduler.profiles[0].picker.max_endpoints == 3
    with pytest.raises(ConfigError, match="maxNumOfEndpoints"):
        parse_config(HEADER + "plugins:\n- type: max-score-picker\n  parameters: {maxNumOfEndpoints: 0}\n")
