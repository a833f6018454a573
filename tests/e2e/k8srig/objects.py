"""Builders for the small manifests the e2e tests create (plain dicts, as `kubectl apply` would send)."""
from __future__ import annotations

ECHO_IMAGE = "gcr.io/k8s-staging-gateway-api/echo-basic:v20251106-v1.3.0-263-g47c3435c"
SHELL_IMAGE = "busybox:1.36"


def namespace(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}


def downward_env() -> list[dict]:
    return [{"name": n, "valueFrom": {"fieldRef": {"fieldPath": p}}}
            for n, p in (("POD_NAME", "metadata.name"), ("NAMESPACE", "metadata.namespace"),
                         ("POD_NAMESPACE", "metadata.namespace"), ("POD_IP", "status.podIP"))]


def echo_container(port: int = 3000, name: str = "echo") -> dict:
    """The conformance echo backend, as upstream's manifests run it (HTTP readiness probe on its port)."""
    return {"name": name, "image": ECHO_IMAGE, "ports": [{"containerPort": port}],
            "env": [{"name": "HTTP_PORT", "value": str(port)}, {"name": "H2C_PORT", "value": str(port + 1)},
                    *downward_env()],
            "readinessProbe": {"httpGet": {"path": "/health", "port": port}, "periodSeconds": 1,
                               "failureThreshold": 2},
            "livenessProbe": {"tcpSocket": {"port": port}, "periodSeconds": 2, "failureThreshold": 3}}


def kvgate_container(args: list[str], port: int, name: str = "kvgate",
                     image: str = "ghcr.io/kvgate/kvgate:dev") -> dict:
    """A container of the project's image (the pod runner runs the local `kvgate` command), e.g.
    kvgate_container(["serve", "demo", "--backend", "sim", "--host", "0.0.0.0", "--port", "8000"], 8000)."""
    return {"name": name, "image": image, "args": args, "ports": [{"containerPort": port}],
            "env": downward_env(),
            "readinessProbe": {"httpGet": {"path": "/health", "port": port}, "periodSeconds": 1}}


def deployment(name: str, namespace: str, containers: list[dict], replicas: int = 1,
               volumes: list[dict] | None = None) -> dict:
    labels = {"app": name}
    spec: dict = {"containers": containers, "terminationGracePeriodSeconds": 2}
    if volumes:
        spec["volumes"] = volumes
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": namespace, "labels": labels},
            "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels}, "spec": spec}}}


def pod(name: str, namespace: str, containers: list[dict], *, restart_policy: str = "Always",
        volumes: list[dict] | None = None, labels: dict | None = None,
        init_containers: list[dict] | None = None) -> dict:
    spec: dict = {"containers": containers, "restartPolicy": restart_policy, "terminationGracePeriodSeconds": 2}
    if volumes:
        spec["volumes"] = volumes
    if init_containers:
        spec["initContainers"] = init_containers
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": labels or {"app": name}},
            "spec": spec}


def service(name: str, namespace: str, selector: dict, port: int, target_port: int) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": namespace},
            "spec": {"selector": selector, "ports": [{"name": "http", "port": port, "targetPort": target_port,
                                                      "protocol": "TCP"}]}}


def config_map(name: str, namespace: str, data: dict[str, str]) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": namespace},
            "data": data}
