"""A stock Envoy config in upstream's shape (upstream-envoy.yaml, next to this file): what `kvgate epp` must work
behind as a drop-in. Used by the tests and by `kvgate bench chaos` to run the same faults behind it as behind
kvgate's own rendered config."""

from __future__ import annotations

from pathlib import Path
from string import Template

import yaml

UPSTREAM_ENVOY_YAML = Path(__file__).with_name("upstream-envoy.yaml")


def render_upstream_envoy(port: int, admin_port: int, epp_port: int) -> dict:
    """The stock config with its ports filled in (listener and admin on loopback, the EPP on loopback)."""
    text = Template(UPSTREAM_ENVOY_YAML.read_text()).substitute(LISTEN_PORT=port, ADMIN_PORT=admin_port,
                                                              EPP_PORT=epp_port)
    return yaml.safe_load(text)
