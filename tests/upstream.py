"""Where the tests find the upstream files they check kvgate against: vendored in the repository (third_party/README.md
names each file's source commit and license). A missing file is a test error, never a skip."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THIRD_PARTY = ROOT / "third_party"
GATEWAY_API = THIRD_PARTY / "gateway-api"  # the Gateway API standard-channel CRDs
UPSTREAM_POOL_CRD = THIRD_PARTY / "gateway-api-inference-extension" / "inferencepools.crd.yaml"
CONFORMANCE = ROOT / "conformance" / "manifests"  # the Inference Extension's conformance manifests, as shipped


def gateway_api_crds() -> list[Path]:
    """The four Gateway API CRD files (GatewayClass, Gateway, HTTPRoute, ReferenceGrant)."""
    files = sorted(GATEWAY_API.glob("*.crd.yaml"))
    assert len(files) == 4, f"the vendored Gateway API CRDs are missing from {GATEWAY_API}: {files}"
    return files


def upstream_crds() -> list[Path]:
    """Every upstream CRD the rig installs: Gateway API's and the InferencePool's."""
    assert UPSTREAM_POOL_CRD.is_file(), f"the vendored InferencePool CRD is missing: {UPSTREAM_POOL_CRD}"
    return gateway_api_crds() + [UPSTREAM_POOL_CRD]
