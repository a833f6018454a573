"""The EndpointPickerConfig the conformance suite runs `kvgate epp` with (in place of upstream's test EPP).

Upstream's conformance EPP steers each request to the endpoints a test names (`test-epp-endpoint-selection`) and
echoes the endpoint the gateway reports as served (`x-conformance-test-served-endpoint`). kvgate has both as
plugins, and they run only in a config that names them — this one, passed with `--config-text` — never in the
default config, where a client must not be able to pick its pod or learn pod addresses.
"""

from __future__ import annotations

CONFORMANCE_EPP_CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: header-based-testing-filter
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: max-score-picker
- type: destination-endpoint-served-verifier
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: header-based-testing-filter
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
  - pluginRef: max-score-picker
"""
