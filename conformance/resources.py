"""Names of the shared objects in base.yaml (upstream's conformance/resources), for the tests to refer to."""

from __future__ import annotations

from kvgate.conformance.cluster import DEPLOYMENT, GATEWAY, HTTPROUTE, POD, POOL, SERVICE  # noqa: F401

INFRA_NS = "inference-conformance-infra"
APP_BACKEND_NS = "inference-conformance-app-backend"

PRIMARY_GATEWAY = (INFRA_NS, "conformance-primary")
SECONDARY_GATEWAY = (INFRA_NS, "conformance-secondary")
BASE_GATEWAYS = (PRIMARY_GATEWAY, SECONDARY_GATEWAY)

PRIMARY_POOL = (APP_BACKEND_NS, "primary-inference-pool")
SECONDARY_POOL = (APP_BACKEND_NS, "secondary-inference-pool")
DP_POOL = (APP_BACKEND_NS, "dp-inference-pool")
APPPROTOCOL_HTTP_POOL = (APP_BACKEND_NS, "appprotocol-http-inference-pool")
APPPROTOCOL_H2C_POOL = (APP_BACKEND_NS, "appprotocol-h2c-inference-pool")

PRIMARY_BACKEND = "primary-inference-model-server-deployment"
SECONDARY_BACKEND = "secondary-inference-model-server-deployment"
APPPROTOCOL_BACKEND = "appprotocol-inference-model-server-deployment"
DP_BACKEND = "dp-inference-model-server-deployment"

PRIMARY_BACKEND_LABELS = {"app": "primary-inference-model-server"}
SECONDARY_BACKEND_LABELS = {"app": "secondary-inference-model-server"}
APPPROTOCOL_BACKEND_LABELS = {"app": "appprotocol-inference-model-server"}
DP_BACKEND_LABELS = {"app": "dp-inference-model-server"}

PRIMARY_EPP = "primary-app-endpoint-picker"
SECONDARY_EPP = "secondary-app-endpoint-picker"
DP_EPP = "dp-app-endpoint-picker"

BASE_DEPLOYMENTS = (PRIMARY_BACKEND, SECONDARY_BACKEND, APPPROTOCOL_BACKEND, DP_BACKEND, PRIMARY_EPP,
                    SECONDARY_EPP, DP_EPP, "appprotocol-http-app-endpoint-picker",
                    "appprotocol-h2c-app-endpoint-picker")

PRIMARY_EPP_SERVICE = "primary-endpoint-picker-svc"
SECONDARY_EPP_SERVICE = "secondary-endpoint-picker-svc"
