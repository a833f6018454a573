"""The EndpointPickerConfig the conformance suite runs `kvgate epp` with (in place of upstream's test EPP).

Upstream's conformance EPP steers each request to the endpoints a test names (`test-epp-endpoint-selection`) and
echoes the endpoint the gateway reports as served (`x-conformance-test-served-endpoint`). kvgate has both as
plugins, and they run only in a config that names them — this one, passed with `--config-text` — never in the
default config, where a client must not be able to pick its pod or learn pod addresses. Otherwise it is the
default config: the same scorers, weights and picker.
"""

from __future__ import annotations

import yaml

from kvgate.epp.scheduling.config import DEFAULT_CONFIG_YAML, SERVED_VERIFIER

SELECTION_FILTER = "header-based-testing-filter"


def conformance_config_yaml() -> str:
    """The default config with the selection filter first in its profile and the served-endpoint verifier."""
    doc = yaml.safe_load(DEFAULT_CONFIG_YAML)
    doc["plugins"] = [{"type": SELECTION_FILTER}, *doc["plugins"], {"type": SERVED_VERIFIER}]
    doc["schedulingProfiles"][0]["plugins"].insert(0, {"pluginRef": SELECTION_FILTER})
    return yaml.safe_dump(doc, sort_keys=False)


CONFORMANCE_EPP_CONFIG = conformance_config_yaml()
