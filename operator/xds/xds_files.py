"""A Gateway's Envoy config in its xDS form: the same file set render_gateway_files makes, with every config
source switched to ADS, the listeners moved out of the bootstrap into `lds.yaml`, and a bootstrap that holds
only what Envoy needs before it can reach the operator (node, admin, overload manager, static clusters such as
the trace collector's, and the operator's xDS cluster).

The operator writes this file set into the Gateway's ConfigMap; the Envoy pods mount only its bootstrap key, so a
route, pool or listener change never rolls them (and the kubelet's ConfigMap sync is out of the path), while
every operator replica's xDS server serves the other keys (snapshot.py).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from kvgate.common.gateway_routes import BOOTSTRAP_FILE, CDS_FILE

LDS_FILE = "lds.yaml"
LISTENER_TYPE = "type.googleapis.com/envoy.config.listener.v3.Listener"
XDS_CLUSTER = "kvgate-xds"  # the bootstrap's static cluster of the operator's xDS Service
ADS_SOURCE = {"ads": {}, "resource_api_version": "V3"}
_HTTP2 = {"@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
          "explicit_http_config": {"http2_protocol_options": {}}}


@dataclass(frozen=True)
class XdsAddress:
    """Where the Gateways' Envoys reach the operator's xDS server (its Service's DNS name, or an IP)."""
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> "XdsAddress":
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or len(text) > 253:
            raise ValueError(f"an xDS address is HOST:PORT, got {text!r}")
        return cls(host.strip("[]"), int(port))


def xds_cluster(address: XdsAddress) -> dict:
    """The static cluster of the operator's xDS server: HTTP/2, DNS-resolved (every operator replica behind one
    Service), with TCP keepalives so that a vanished replica is noticed and Envoy reconnects to another."""
    return {"name": XDS_CLUSTER, "type": "STRICT_DNS", "connect_timeout": "5s", "dns_lookup_family": "V4_PREFERRED",
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": copy.deepcopy(_HTTP2)},
            "upstream_connection_options": {"tcp_keepalive": {"keepalive_time": 30, "keepalive_interval": 10,
                                                              "keepalive_probes": 3}},
            "load_assignment": {"cluster_name": XDS_CLUSTER, "endpoints": [{"lb_endpoints": [{"endpoint": {
                "address": {"socket_address": {"address": address.host, "port_value": address.port}}}}]}]}}


def _hcms(listener_doc: dict):
    for chain in listener_doc.get("filter_chains") or []:
        for network_filter in chain.get("filters") or []:
            config = network_filter.get("typed_config") or {}
            if "rds" in config:
                yield config


def _ads_cluster(cluster: dict) -> dict:
    eds = cluster.get("eds_cluster_config")
    if eds is None:
        return cluster
    return {**cluster, "eds_cluster_config": {**eds, "eds_config": dict(ADS_SOURCE)}}


def xds_files(files: dict[str, dict], address: XdsAddress) -> dict[str, dict]:
    """render_gateway_files' `files` in xDS form: {envoy.yaml: the bootstrap, lds.yaml: the listeners,
    rds-<port>.yaml, cds.yaml, eds-<cluster>.yaml: the route tables, clusters and EPP endpoints}."""
    bootstrap = copy.deepcopy(files[BOOTSTRAP_FILE])
    static = bootstrap.setdefault("static_resources", {})
    listeners = static.pop("listeners", [])
    for listener_doc in listeners:
        for hcm in _hcms(listener_doc):
            hcm["rds"]["config_source"] = dict(ADS_SOURCE)
    static["clusters"] = [*static.get("clusters", []), xds_cluster(address)]
    bootstrap["dynamic_resources"] = {
        "ads_config": {"api_type": "GRPC", "transport_api_version": "V3", "set_node_on_first_message_only": True,
                       "grpc_services": [{"envoy_grpc": {"cluster_name": XDS_CLUSTER}}]},
        "cds_config": dict(ADS_SOURCE), "lds_config": dict(ADS_SOURCE)}
    out = {name: copy.deepcopy(doc) for name, doc in files.items() if name != BOOTSTRAP_FILE}
    out[BOOTSTRAP_FILE] = bootstrap
    out[LDS_FILE] = {"resources": [{"@type": LISTENER_TYPE, **l} for l in listeners]}
    out[CDS_FILE] = {"resources": [_ads_cluster(c) for c in files[CDS_FILE].get("resources") or []]}
    return out


def is_xds_file_set(files: dict) -> bool:
    return LDS_FILE in files
