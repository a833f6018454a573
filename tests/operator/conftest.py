"""Fixtures of the operator's unit tests: the CRD samples and upstream's conformance manifests."""

from pathlib import Path

import pytest
import yaml

from tests.upstream import CONFORMANCE

REPO = Path(__file__).resolve().parents[2]
NOW = "2025-01-01T00:00:00Z"


def load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.fixture
def samples() -> dict[str, dict]:
    """kind -> the sample of crds/samples/, placed in namespace "default" with a uid."""
    out = {}
    for path in sorted((REPO / "crds" / "samples").glob("*.yaml")):
        for doc in load_docs(path):
            doc["metadata"].setdefault("namespace", "default")
            doc["metadata"]["uid"] = f"uid-{doc['metadata']['name']}"
            doc["metadata"]["generation"] = 1
            out[doc["kind"]] = doc
    return out


@pytest.fixture
def conformance():
    """A loader of upstream conformance manifests (base.yaml plus the named files)."""

    def load(*names: str) -> list[dict]:
        docs = []
        for name in ("base.yaml", *names):
            for doc in load_docs(CONFORMANCE / name):
                if doc.get("kind") == "Gateway":
                    doc["spec"]["gatewayClassName"] = "kvgate"
                docs.append(doc)
        return docs
    return load


def round_trips(obj: dict) -> bool:
    """Whether the kubernetes client's model of obj's kind reads and writes it back unchanged: catches
    misspelled or misplaced fields, which the client's models drop, and missing required ones."""
    from kubernetes.client import ApiClient

    client = ApiClient()
    model = client._ApiClient__deserialize(obj, f"V1{obj['kind']}")
    return client.sanitize_for_serialization(model) == obj
