"""Unit tests of the rig's other parts: the 1.20 manifest transform, the echo server, volume writes, kube
client helpers. No control plane needed; not in the e2e tier."""
from __future__ import annotations

import json
import http.client
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from k8srig import BuildFailed, Unavailable, crds, echoserver, ensure_binaries
from k8srig.kube import Client, Kubeconfig, Resource, load_documents
from k8srig.podrunner import PodWorker, Runner, write_atomic_volume

from tests.upstream import upstream_crds


def _walk(node, key):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == key:
                yield v
            yield from _walk(v, key)
    elif isinstance(node, list):
        for x in node:
            yield from _walk(x, key)


# --- the 1.20 transform --------------------------------------------------------------------------------------

def test_crd_transform_drops_cel_and_empty_string_defaults_only():
    crd = {"kind": "CustomResourceDefinition", "spec": {"versions": [{"name": "v1", "schema": {"openAPIV3Schema": {
        "type": "object", "x-kubernetes-validations": [{"rule": "self.a > 0"}],
        "properties": {"a": {"type": "integer", "default": 1},
                       "b": {"type": "string", "default": ""},
                       "default": {"type": "string", "x-kubernetes-validations": [{"rule": "x"}]}}}}}]}}
    out = crds.crd_for_1_20(crd)
    schema = out["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert "x-kubernetes-validations" not in schema
    assert schema["properties"]["a"]["default"] == 1 and "default" not in schema["properties"]["b"]
    assert schema["properties"]["default"] == {"type": "string"}
    assert "x-kubernetes-validations" in crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]  # input untouched


def test_upstream_crds_lose_every_rejected_key():
    files = upstream_crds()
    assert any(list(_walk(load_documents(f.read_text()), "x-kubernetes-validations")) for f in files)
    for f in files:
        for doc in load_documents(f.read_text()):
            out = crds.crd_for_1_20(doc)
            assert not list(_walk(out, "x-kubernetes-validations"))
            assert "" not in list(_walk(out, "default"))


def test_grpc_probes_become_tcp_probes_in_pod_templates():
    dep = {"kind": "Deployment", "spec": {"template": {"spec": {"containers": [{
        "name": "epp", "livenessProbe": {"grpc": {"port": 9003, "service": "x"}, "periodSeconds": 10},
        "readinessProbe": {"httpGet": {"port": 80}}}]}}}}
    out = crds.manifest_for_1_20(dep)
    c = out["spec"]["template"]["spec"]["containers"][0]
    assert c["livenessProbe"] == {"tcpSocket": {"port": 9003}, "periodSeconds": 10}
    assert c["readinessProbe"] == {"httpGet": {"port": 80}}
    assert crds.manifest_for_1_20({"kind": "Service", "spec": {}}) == {"kind": "Service", "spec": {}}


# --- echo server ---------------------------------------------------------------------------------------------

def test_echo_document_matches_upstream_shape():
    doc = echoserver.echo_document(path="/a?b=1", host="h:80", method="GET", proto="HTTP/1.1",
                                   headers=[("host", "h:80"), ("x-foo", "1"), ("X-FOO", "2"), ("user-agent", "t")],
                                   context=echoserver.context_from_env({"NAMESPACE": "ns", "POD_NAME": "p"}))
    assert doc == {"path": "/a?b=1", "host": "h:80", "method": "GET", "proto": "HTTP/1.1",
                   "headers": {"X-Foo": ["1", "2"], "User-Agent": ["t"]},
                   "namespace": "ns", "ingress": "", "service": "", "pod": "p", "sni": ""}
    assert echoserver.parse_go_duration("1m1.5s") == 61.5
    with pytest.raises(ValueError):
        echoserver.parse_go_duration("5 s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_echo_server_process_answers_on_its_pod_ip():
    port, h2c = _free_port(), _free_port()
    ip = "127.0.0.1"
    env = {"K8SRIG_POD_IP": ip, "HTTP_PORT": str(port), "H2C_PORT": str(h2c), "POD_NAME": "echo-1",
           "NAMESPACE": "ns"}
    proc = subprocess.Popen([sys.executable, echoserver.__file__], env=env, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                conn = http.client.HTTPConnection(ip, port, timeout=2)
                conn.request("GET", "/x/y?delay=10ms", headers={"X-Echo-Set-Header": "X-A:1,X-B:2"})
                r = conn.getresponse()
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.05)
        body = json.loads(r.read())
        assert r.status == 200 and r.getheader("X-A") == "1" and r.getheader("X-B") == "2"
        assert (body["pod"], body["namespace"], body["path"], body["method"]) == ("echo-1", "ns", "/x/y?delay=10ms", "GET")
        assert body["headers"]["X-Echo-Set-Header"] == ["X-A:1,X-B:2"]
        conn.request("GET", "/status/418")
        r = conn.getresponse()
        assert r.status == 418 and r.read() == b""
        # A chunked body (as a proxy streaming a request sends it) is read whole: the keep-alive connection
        # then serves the next request, which a left-over body would corrupt.
        conn.request("POST", "/chunked", body=iter([b'{"model": ', b'"m"}']), encode_chunked=True)
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["path"] == "/chunked"
        conn.request("GET", "/after")
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["path"] == "/after"
        conn.close()
        conn = http.client.HTTPConnection(ip, h2c, timeout=2)
        conn.request("GET", "/")
        assert conn.getresponse().status == 400      # HTTP/1 on the h2c port, as upstream answers
        conn.close()
        import httpx                                  # h2c with prior knowledge, as Envoy speaks it
        with httpx.Client(http1=False, http2=True, timeout=5) as h2:
            r = h2.post(f"http://{ip}:{h2c}/v1/completions", json={"model": "m"})
            assert r.http_version == "HTTP/2" and r.status_code == 200 and r.json()["proto"] == "HTTP/2.0"
            assert r.json()["pod"] == "echo-1" and "httpPort" not in r.json()
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0


# --- volumes and client bits ---------------------------------------------------------------------------------

def test_write_atomic_volume_swaps_data_like_the_kubelet(tmp_path):
    d = tmp_path / "vol"
    assert write_atomic_volume(d, {"a.txt": b"1", "sub/b.txt": b"2"})
    assert (d / "a.txt").read_bytes() == b"1" and (d / "sub" / "b.txt").read_bytes() == b"2"
    assert (d / "a.txt").is_symlink() and (d / "..data").is_symlink()
    first = (d / "..data").resolve()
    assert not write_atomic_volume(d, {"a.txt": b"1", "sub/b.txt": b"2"})     # unchanged: no swap
    assert write_atomic_volume(d, {"a.txt": b"3"})
    assert (d / "a.txt").read_bytes() == b"3" and not (d / "sub").exists() and not first.exists()


def test_a_pod_keeps_its_volumes_while_the_api_server_is_unreachable(tmp_path):
    """The kubelet keeps running pods when the API server is gone (Rig.stop_apiserver): a volume refresh that
    cannot reach it keeps what is mounted. (It used to raise ConnectionRefusedError, and the pod's worker
    stopped every container.)"""
    client = Client(Kubeconfig(server=f"http://127.0.0.1:{_free_port()}", ca_pem=None))  # nobody listens there
    runner = Runner(client, node_name="n", run_dir=tmp_path, pod_network="127.99", images=None,
                    backoff_base_s=1, backoff_cap_s=1)
    worker = PodWorker(runner, {"metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
                                "spec": {"containers": [{"name": "c", "image": "busybox"}],
                                         "volumes": [{"name": "cfg", "configMap": {"name": "cfg"}}]}})
    worker.mounts_ready = True  # mounted while the API server was up
    worker.refresh_volumes(worker.pod)
    assert worker.mounts_ready and "refused" in worker.volume_error.lower(), worker.volume_error


def test_a_host_path_volume_is_the_nodes_own_folder(tmp_path):
    """hostPath: the container's paths under the mount point are the node's folder itself (a ModelServer's
    model.hostPath); a Directory that is not there holds the pod in ContainerCreating with the reason."""
    model = tmp_path / "models" / "m"
    model.mkdir(parents=True)
    client = Client(Kubeconfig(server=f"http://127.0.0.1:{_free_port()}", ca_pem=None))
    runner = Runner(client, node_name="n", run_dir=tmp_path / "run", pod_network="127.99", images=None,
                    backoff_base_s=1, backoff_cap_s=1)
    container = {"name": "c", "image": "busybox",
                 "volumeMounts": [{"name": "model", "mountPath": "/models/demo", "readOnly": True}]}
    pod = {"metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
           "spec": {"containers": [container],
                    "volumes": [{"name": "model", "hostPath": {"path": str(model), "type": "Directory"}}]}}
    worker = PodWorker(runner, pod)
    worker.refresh_volumes(pod)
    assert worker.mounts_ready and worker.volume_error == ""
    assert worker.mounts_for(container) == {"/models/demo": str(model)}
    pod["spec"]["volumes"][0]["hostPath"]["path"] = str(tmp_path / "missing")
    worker.refresh_volumes(pod)
    assert not worker.mounts_ready and "is not a directory" in worker.volume_error


def test_a_binding_the_api_server_refuses_is_tried_again(tmp_path, monkeypatch):
    """A kube-scheduler retries a pod it failed to bind; the rig's runner once logged the failure and left the
    pod Pending for good (no further watch event comes for a pod nobody bound). The fake API server answers the
    first binding 500, the second 201; a deleted pod is not bound again."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from k8srig import podrunner
    monkeypatch.setattr(podrunner, "BIND_RETRY_S", 0.05)
    bindings: list[str] = []
    deleted: set[str] = set()

    class FakeApi(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _answer(self, code: int, doc: dict) -> None:
            body = json.dumps(doc).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            name = self.path.rsplit("/", 1)[1]
            md = {"name": name, "namespace": "ns", "uid": f"uid-{name}"}
            if name in deleted:
                md["deletionTimestamp"] = "2026-01-01T00:00:00Z"
            self._answer(200, {"metadata": md, "spec": {"containers": []}})

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            name = self.path.split("/")[-2]
            bindings.append(name)
            if bindings.count(name) == 1:
                self._answer(500, {"kind": "Status", "message": "etcdserver: request timed out", "code": 500})
            else:
                self._answer(201, {"kind": "Status", "status": "Success"})

    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeApi)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    runner = Runner(Client(Kubeconfig(server=f"http://127.0.0.1:{server.server_address[1]}", ca_pem=None)),
                    node_name="n", run_dir=tmp_path, pod_network="127.99", images=None,
                    backoff_base_s=1, backoff_cap_s=1)
    retries = threading.Thread(target=runner.bind_retry_loop, daemon=True)
    try:
        deleted.add("gone")
        for name in ("p", "gone"):
            runner.bind({"metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}"}, "spec": {}})
        assert set(runner.unbound) == {("ns", "p"), ("ns", "gone")}
        retries.start()
        deadline = time.monotonic() + 10
        while runner.unbound and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not runner.unbound and bindings.count("p") == 2 and bindings.count("gone") == 1, bindings
    finally:
        runner.stop_event.set()
        retries.join(timeout=5)
        server.shutdown()
        server.server_close()


def test_a_late_event_for_a_pod_run_to_its_end_starts_no_second_worker(tmp_path):
    """The watch lags a worker's final delete: a MODIFIED event for the deleted pod can arrive after its worker left
    the runner's table. A second worker then started for the same UID, made the same cgroup path, which the first
    removed as it left; every NetworkPolicy load failed on the missing path from then on, and each pod created
    later stayed Pending (CI, `test_rollouts_under_streaming_load`). Now the UID is remembered, a pod whose cgroup is
    gone is left out of the ruleset, and a worker waiting for the network gives up once its pod is gone."""
    from types import SimpleNamespace
    client = Client(Kubeconfig(server=f"http://127.0.0.1:{_free_port()}", ca_pem=None))  # nobody listens there
    runner = Runner(client, node_name="n", run_dir=tmp_path, pod_network="127.99", images=None,
                    backoff_base_s=1, backoff_cap_s=1)
    pod = {"metadata": {"name": "p", "namespace": "ns", "uid": "u1", "deletionTimestamp": "2026-01-01T00:00:00Z"},
           "spec": {"nodeName": "n", "containers": [{"name": "c", "image": "busybox"}]},
           "status": {"phase": "Running"}}
    worker = PodWorker(runner, pod)
    runner.workers[worker.key] = worker
    worker.completed = True            # as after its final delete
    runner.worker_done(worker)
    runner.observe("MODIFIED", pod)
    assert runner.workers == {} and "u1" in runner.finished

    crashed = PodWorker(runner, {**pod, "metadata": {**pod["metadata"], "uid": "u2"}})
    runner.workers[crashed.key] = crashed
    runner.worker_done(crashed)        # not completed (a crash): the next list may start it again
    assert "u2" not in runner.finished

    runner.cgroups = SimpleNamespace(nft_path=str)
    worker.cgroup = tmp_path / "cgroup-removed"
    assert worker.policy_info() is None
    worker.cgroup.mkdir()
    assert worker.policy_info().name == "p"

    runner.policy = SimpleNamespace(sync=lambda: (_ for _ in ()).throw(RuntimeError("nft -f failed")))
    runner.cgroups = SimpleNamespace(create=lambda uid: tmp_path / f"pod-{uid}")
    waiting = PodWorker(runner, {**pod, "metadata": {**pod["metadata"], "uid": "u3"}})
    waiting.mark_gone()
    began = time.monotonic()
    assert waiting.join_network(runner.stop_event) is False and waiting.completed
    assert time.monotonic() - began < 0.5


def test_resource_paths_and_kubeconfig_round_trip(tmp_path):
    pods = Resource("v1", "Pod", "pods", True)
    assert pods.path("ns", "p", "status") == "/api/v1/namespaces/ns/pods/p/status"
    assert Resource("apps/v1", "Deployment", "deployments", True).path("ns") == "/apis/apps/v1/namespaces/ns/deployments"
    assert Resource("v1", "Node", "nodes", False).path("ignored", "n") == "/api/v1/nodes/n"
    kc = Kubeconfig(server="https://127.0.0.1:6443", ca_pem=b"PEM", token="t")
    (tmp_path / "kc").write_text(kc.to_yaml())
    again = Kubeconfig.load(tmp_path / "kc")
    assert (again.server, again.ca_pem, again.token) == ("https://127.0.0.1:6443", b"PEM", "t")


def test_a_watch_cut_mid_stream_raises_an_oserror_the_callers_retry_on():
    """An API server killed during a watch ends the chunked answer mid-chunk: http.client's IncompleteRead is no
    OSError, and the pod runner's watch loop (which retries on OSError) once died of it, stranding new pods."""
    import threading
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def serve_one_event_then_die() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.recv(65536)
            event = json.dumps({"type": "ADDED", "object": {"metadata": {"name": "p"}}}).encode() + b"\n"
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                         + f"{len(event):x}\r\n".encode() + event + b"\r\n" + b"40\r\n{\"type\":")  # cut inside a chunk
    server = threading.Thread(target=serve_one_event_then_die, daemon=True)
    server.start()
    try:
        client = Client(Kubeconfig(server=f"http://127.0.0.1:{port}", ca_pem=None))
        events = []
        with pytest.raises(OSError, match="cut"):
            for ev in client.watch(Resource("v1", "Pod", "pods", True), timeout_s=5):
                events.append(ev["object"]["metadata"]["name"])
        assert events == ["p"]
    finally:
        server.join(timeout=5)
        srv.close()


# --- build outcomes ------------------------------------------------------------------------------------------

def _script(tmp_path, body: str) -> Path:
    p = tmp_path / "build"
    p.write_text("#!/usr/bin/env bash\n" + body)
    return p


def test_build_outcomes_map_to_skip_fail_and_binaries(tmp_path):
    log = tmp_path / "build.log"
    unavailable = _script(tmp_path, '[[ "$1" == --check ]] && exit 1\necho "[b] UNAVAILABLE: no apt-get here" >&2; exit 3\n')
    with pytest.raises(Unavailable, match="no apt-get here"):
        ensure_binaries(log, script=unavailable)
    broken = _script(tmp_path, '[[ "$1" == --check ]] && exit 1\necho "make: *** boom" >&2; exit 2\n')
    with pytest.raises(BuildFailed, match="boom"):
        ensure_binaries(log, script=broken)
    built = _script(tmp_path, '[[ "$1" == --check ]] && exit 1\necho noise >&2; echo /opt/k8s/bin\n')
    b = ensure_binaries(log, script=built)
    assert b.dir == Path("/opt/k8s/bin") and b.built_s is not None
    cached = _script(tmp_path, 'echo /opt/cache/bin\n')
    assert ensure_binaries(log, script=cached).built_s is None


def test_pod_networks_are_exclusive_and_released():
    import random
    from k8srig.controlplane import claim_pod_network, release_pod_network
    a = claim_pod_network(random.Random(1))
    b = claim_pod_network(random.Random(1))          # same first choice: must skip the held one
    assert a[0] != b[0]
    release_pod_network(a[1], a[2])
    release_pod_network(b[1], b[2])
    assert not Path(a[2]).exists() and not Path(b[2]).exists()


# --- the service proxy -----------------------------------------------------------------------------------------

def test_service_proxy_listeners_follow_services_and_ready_slices():
    from k8srig.serviceproxy import Backend, desired_listeners

    def svc(name, ip, ports, **spec):
        return {"metadata": {"namespace": "ns", "name": name}, "spec": {"clusterIP": ip, "ports": ports, **spec}}

    def slice_(svc_name, eps, ports):
        return {"metadata": {"namespace": "ns", "labels": {"kubernetes.io/service-name": svc_name}},
                "endpoints": eps, "ports": ports}

    services = [svc("web", "127.5.240.9", [{"name": "http", "port": 80}, {"name": "m", "port": 9090},
                                           {"name": "u", "port": 53, "protocol": "UDP"}]),
                svc("headless", "None", [{"port": 80}]),
                svc("ext", "", [{"port": 80}], type="ExternalName"),
                svc("empty", "127.5.240.10", [{"port": 8000}])]
    slices = [slice_("web", [{"addresses": ["127.5.0.2"], "conditions": {"ready": True}},
                             {"addresses": ["127.5.0.3"], "conditions": {"ready": False}},
                             {"addresses": ["127.5.0.4"]}],
                     [{"name": "http", "port": 3000}, {"name": "m", "port": 9091}]),
              slice_("other", [{"addresses": ["127.5.0.9"]}], [{"name": "http", "port": 1}])]
    assert desired_listeners(services, slices) == {
        ("127.5.240.9", 80): [Backend("127.5.0.2", 3000), Backend("127.5.0.4", 3000)],
        ("127.5.240.9", 9090): [Backend("127.5.0.2", 9091), Backend("127.5.0.4", 9091)],
        ("127.5.240.10", 8000): [],  # no endpoints yet: listens, and resets connections
    }


def test_service_range_is_loopback_above_the_pods():
    import ipaddress

    from k8srig.controlplane import SERVICE_BLOCK, kubernetes_service_ip, service_cidr

    net = ipaddress.ip_network(service_cidr("127.42"))
    assert net.subnet_of(ipaddress.ip_network("127.42.0.0/16")) and net.is_loopback
    assert ipaddress.ip_address(kubernetes_service_ip("127.42")) == net.network_address + 1
    assert ipaddress.ip_address(f"127.42.{SERVICE_BLOCK - 1}.254") not in net
