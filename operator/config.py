"""The operator's settings: what `kvgate operator`'s flags (main.py) hand the reconcilers."""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.common.envoy_config import EnvoyTracing
from kvgate.operator.tenancy import TenantPolicy
from kvgate.operator.xds.xds_files import XdsAddress


@dataclass(frozen=True)
class TraceExport:
    """OpenTelemetry (--otlp-traces-endpoint, --trace-sampling-ratio): the OTLP/gRPC collector that the Gateways'
    Envoys and the pools' EPPs send request spans to, and the share of requests without a sampling decision that
    are traced (a client's or Envoy's sampled `traceparent` is always followed)."""
    endpoint: str
    sampling_ratio: float = 1.0

    def env(self, service_name: str) -> list[dict]:
        """A container's OTEL_* variables (kvgate.common.tracing reads them)."""
        return [{"name": "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "value": self.endpoint},
                {"name": "OTEL_TRACES_SAMPLER", "value": "parentbased_traceidratio"},
                {"name": "OTEL_TRACES_SAMPLER_ARG", "value": f"{self.sampling_ratio:g}"},
                {"name": "OTEL_SERVICE_NAME", "value": service_name}]

    def envoy(self) -> EnvoyTracing:
        return EnvoyTracing.from_endpoint(self.endpoint, self.sampling_ratio)


@dataclass
class OperatorConfig:
    engine_image: str
    epp_image: str
    envoy_image: str
    namespace: str | None = None  # None: all namespaces
    # "service": Envoy reaches a pool's EPP by its Service's DNS name (any cluster with Service routing).
    # "pod-ip": by the IP of a ready EPP pod (clusters without Service routing, e.g. the e2e rig).
    epp_address_mode: str = "service"
    envoy_service_type: str = "ClusterIP"
    resync_s: float = 15.0
    # A NetworkPolicy per managed pool's EPP (network_policy.py); the peers that may scrape every EPP's metrics.
    network_policy: bool = True
    epp_metrics_from: tuple = ()
    # Pools may ask for more than one EPP replica (kvgate.dev/epp-replicas): leader election over a Lease, a
    # PodDisruptionBudget. Off by default, and then the operator holds no Lease or PDB permissions.
    epp_high_availability: bool = False
    # What ModelServers may use beyond the default (tenancy.py): --allow-host-path, --allow-image-prefix.
    tenant_policy: TenantPolicy = TenantPolicy()
    # The images of ModelServers with engine.type vllm or sglang that name no spec.image (--vllm-image,
    # --sglang-image); None: such a ModelServer must name its image (and an allowed prefix must cover it).
    vllm_image: str | None = None
    sglang_image: str | None = None
    tracing: TraceExport | None = None  # None: no spans exported (no OTEL_* on the EPPs, no tracer in Envoy)
    # Autoscaling (autoscaler.py): how often autoscaled ModelServers are looked at; the Prometheus KEDA queries
    # for ModelServers with autoscaling.provider keda (keda.py; None: such ModelServers get a condition instead).
    autoscale_interval_s: float = 15.0
    keda_prometheus_address: str | None = None
    # Where the Gateways' Envoys get their config (--envoy-config-source): "xds", from the operator's xDS server
    # at xds_address (operator/xds/); "files", from their mounted ConfigMap.
    envoy_config_source: str = "files"
    xds_address: XdsAddress | None = None
    # Where xDS-configured Envoys bind their listeners (--envoy-bind-address): "any" (0.0.0.0), or "pod-ip" for
    # clusters whose pods share one network namespace (the e2e rig).
    envoy_bind_address: str = "any"

    def envoy_xds(self) -> XdsAddress | None:
        """The xDS server the Envoys dial, when they get their config over xDS."""
        return self.xds_address if self.envoy_config_source == "xds" else None

    def engine_images(self) -> dict[str, str]:
        """The operator's image per engine type, for those it has one."""
        images = {"kvgate": self.engine_image, "vllm": self.vllm_image, "sglang": self.sglang_image}
        return {kind: image for kind, image in images.items() if image}
