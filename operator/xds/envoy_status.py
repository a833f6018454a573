"""The leader's side of the Envoys' reports: whether a Gateway's Envoys serve the config just written to its
ConfigMap (its Programmed condition), and the reports of pods that are gone dropped from the ConfigMap."""

from __future__ import annotations

from kvgate.common import bounded_json
from kvgate.operator import naming
from kvgate.operator.apply import Kube
from kvgate.operator.xds.ack_report import patch_annotations, reports_of, stale_keys, xds_programmed
from kvgate.operator.xds.snapshot import config_version


def _ready(pod: dict) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def envoys_programmed(kube: Kube, gateway: dict, config_map: dict, namespace_pods: list[dict]) -> tuple[bool, str, str]:
    """(Programmed, reason, message) of `gateway` from its Envoy pods' reports on `config_map` (as applied)."""
    files = {name: bounded_json.loads(text, bounded_json.CONFIG_BYTES)
             for name, text in (config_map.get("data") or {}).items()}
    version = config_version(files)
    selector = naming.selector_labels("gateway", naming.name_of(gateway))
    pods = [p for p in namespace_pods if not naming.is_deleting(p)
            and all(((p.get("metadata") or {}).get("labels") or {}).get(k) == v for k, v in selector.items())]
    live = {naming.name_of(p) for p in pods}
    stale = stale_keys(config_map, live)
    if stale:
        patch_annotations(kube, naming.namespace_of(config_map), naming.name_of(config_map), dict.fromkeys(stale))
    reports = {pod: report for pod, report in reports_of(config_map).items() if pod in live}
    return xds_programmed(reports, sorted(naming.name_of(p) for p in pods if _ready(p)), version)
