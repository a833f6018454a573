"""A Kubernetes control plane on loopback: etcd + kube-apiserver + kube-controller-manager + the pod runner.

    rig = Rig(binaries); rig.start(); ... rig.kubeconfig ... ; leftovers = rig.stop()

Each start makes fresh certificates, tokens and data in a temporary folder; every process is started in its
own process group with K8SRIG_ID=<rig id> in its environment and is stopped by id on stop(), which then
checks /proc for anything still carrying the marker (and kills and reports it). Where this machine can (root,
nftables, cgroup v2: podnet.unavailable), the pod runner enforces NetworkPolicy ingress (`network_policy`
says whether it does, or why not).
"""
from __future__ import annotations

import fcntl
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from . import podnet, procs
from .assets import Binaries
from .kube import CORE, Client, Kubeconfig, wait_for

PACKAGE_PARENT = Path(__file__).resolve().parent.parent     # tests/e2e: `python -m k8srig.podrunner` from here
# Service cluster IPs come from the top of the rig's own 127.N/16 (pods get the addresses below it), so that
# the pod runner's service proxy can listen on them: loopback only, and no two rigs share a range.
SERVICE_BLOCK = 240                  # 127.N.240.0/20


def service_cidr(pod_network: str) -> str:
    return f"{pod_network}.{SERVICE_BLOCK}.0/20"


def kubernetes_service_ip(pod_network: str) -> str:
    """The first address of the service range: the API server's own `kubernetes` Service."""
    return f"{pod_network}.{SERVICE_BLOCK}.1"


def claim_pod_network(rng: random.Random | None = None) -> tuple[str, int, str]:
    """Pick a free 127.N/16 for this rig's pods, held by an flock (several rigs may run at once).

    Returns ("127.N", lock fd, lock path); release_pod_network() gives it back and removes the file."""
    rng = rng or random.Random()
    candidates = list(range(16, 251))
    rng.shuffle(candidates)
    for n in candidates:
        path = os.path.join(tempfile.gettempdir(), f"k8srig-net-127.{n}.lock")
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # Still the file at that path? (Its previous holder may have unlinked it while we opened it.)
            if os.path.exists(path) and os.stat(path).st_ino == os.fstat(fd).st_ino:
                return f"127.{n}", fd, path
        except OSError:
            pass
        os.close(fd)
    raise RuntimeError("no free 127.N/16 pod network")


def release_pod_network(fd: int, path: str) -> None:
    try:
        os.unlink(path)              # while still holding the lock: nobody can be holding it through this file
    except FileNotFoundError:
        pass
    os.close(fd)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(d: Path, service_ip: str) -> None:
    """CA, apiserver serving certificate (loopback + in-cluster names), service-account key pair."""
    d.mkdir(parents=True, exist_ok=True)
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "ca.key", cwd=d)
    _openssl("req", "-x509", "-new", "-key", "ca.key", "-subj", "/CN=k8srig-ca", "-days", "3650",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature", "-out", "ca.crt", cwd=d)
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "apiserver.key", cwd=d)
    _openssl("req", "-new", "-key", "apiserver.key", "-subj", "/CN=kube-apiserver", "-out", "apiserver.csr", cwd=d)
    sans = ["IP:127.0.0.1", f"IP:{service_ip}", "DNS:localhost", "DNS:kubernetes", "DNS:kubernetes.default",
            "DNS:kubernetes.default.svc", "DNS:kubernetes.default.svc.cluster.local"]
    (d / "apiserver.ext").write_text(f"subjectAltName={','.join(sans)}\nextendedKeyUsage=serverAuth\n"
                                     "keyUsage=critical,digitalSignature,keyEncipherment\n")
    _openssl("x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "3650", "-extfile", "apiserver.ext", "-out", "apiserver.crt", cwd=d)
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=d)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)


@dataclass
class Rig:
    binaries: Binaries
    node_name: str = "k8srig-node"
    backoff_base_s: float = 1.0          # CrashLoopBackOff (kubelet: 10 s / 300 s); short for tests
    backoff_cap_s: float = 30.0
    keep_dir: bool = False               # keep the run folder (logs, certs) after stop()
    startup_timeout_s: float = 120.0
    id: str = field(default_factory=lambda: secrets.token_hex(6))
    dir: Path | None = None
    kubeconfig: Path | None = None
    client: Client | None = None
    pod_network: str = ""                # "127.N": pods get 127.N.x.y
    timings: dict[str, float] = field(default_factory=dict)
    local: bool = True                   # pods run on this machine (tests may inspect their processes)
    enforce_network_policy: bool = True  # NetworkPolicy ingress enforced (podnet.py) where this machine can
    network_policy: str = ""             # after start: "enforced", or why not
    _procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    _apiserver_argv: list[str] = field(default_factory=list)
    _net_lock: int | None = None
    _net_lock_path: str = ""

    @property
    def nft(self) -> str | None:
        return podnet.find_nft(self.binaries.dir)

    # --- start ----------------------------------------------------------------------------------------------
    def _env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", procs.MARKER)}
        env[procs.MARKER] = self.id
        env.update(extra or {})
        return env

    def _start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        assert self.dir is not None
        proc = procs.start_group(argv, env=env or self._env(), log_path=self.dir / "logs" / f"{name}.log",
                                 cwd=str(self.dir))
        self._procs.append((name, proc))
        (self.dir / "pids").mkdir(exist_ok=True)
        (self.dir / "pids" / name).write_text(str(proc.pid))
        return proc

    def _alive(self, name: str, proc: subprocess.Popen) -> bool:
        if proc.poll() is not None:
            log = (self.dir / "logs" / f"{name}.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{name} exited with {proc.returncode} during start-up:\n{log}")
        return True

    def start(self) -> "Rig":
        t0 = time.monotonic()
        try:
            self._start_all()
        except BaseException:
            self.stop()
            raise
        self.timings["start_s"] = time.monotonic() - t0
        return self

    def _start_all(self) -> None:
        t0 = time.monotonic()
        self.dir = Path(tempfile.mkdtemp(prefix=f"k8srig-{self.id}-"))
        pki = self.dir / "pki"
        self.pod_network, self._net_lock, self._net_lock_path = claim_pod_network()
        make_pki(pki, kubernetes_service_ip(self.pod_network))
        etcd_port, peer_port, api_port, kcm_port = (free_port() for _ in range(4))

        tokens = {who: secrets.token_hex(16) for who in ("admin", "controller-manager", "pod-runner")}
        (pki / "tokens.csv").write_text("".join(f'{tok},{who},{who},"system:masters"\n' for who, tok in tokens.items()))
        ca = (pki / "ca.crt").read_bytes()
        server = f"https://127.0.0.1:{api_port}"
        kc = {who: self.dir / f"{who}.kubeconfig" for who in tokens}
        for who, path in kc.items():
            path.write_text(Kubeconfig(server=server, ca_pem=ca, token=tokens[who]).to_yaml("k8srig"))
            path.chmod(0o600)
        self.kubeconfig = kc["admin"]
        self.client = Client.from_kubeconfig(self.kubeconfig)

        # etcd: data on tmpfs when there is one (no fsync cost); it is small.
        shm = Path("/dev/shm")
        etcd_data = Path(tempfile.mkdtemp(prefix=f"k8srig-{self.id}-etcd-", dir=shm if shm.is_dir() else self.dir))
        (self.dir / "etcd-data").write_text(str(etcd_data))
        etcd = self._start("etcd", [
            str(self.binaries.etcd), "--name", "k8srig", "--data-dir", str(etcd_data),
            "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
            "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-cluster", f"k8srig=http://127.0.0.1:{peer_port}",
            "--logger", "zap", "--log-level", "warn", "--quota-backend-bytes", str(2 * 1024 ** 3)])

        def etcd_healthy() -> bool:
            self._alive("etcd", etcd)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{etcd_port}/health", timeout=2) as r:
                    return json.loads(r.read()).get("health") == "true"
            except OSError:
                return False
        wait_for(etcd_healthy, timeout_s=30, what="etcd /health")
        self.timings["etcd_ready_s"] = time.monotonic() - t0

        self._apiserver_argv = [
            str(self.binaries.apiserver),
            f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            "--bind-address=127.0.0.1", f"--secure-port={api_port}", "--advertise-address=127.0.0.1",
            "--insecure-port=0", f"--cert-dir={self.dir / 'apiserver-certs'}",
            f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}", f"--token-auth-file={pki / 'tokens.csv'}",
            f"--requestheader-client-ca-file={pki / 'ca.crt'}",
            "--authorization-mode=RBAC", "--allow-privileged=true",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-cluster-ip-range={service_cidr(self.pod_network)}", "--endpoint-reconciler-type=none",
            "--profiling=false", "--v=1"]
        self.start_apiserver()
        self.timings["apiserver_ready_s"] = time.monotonic() - t0

        kcm = self._start("kube-controller-manager", [
            str(self.binaries.controller_manager),
            f"--kubeconfig={kc['controller-manager']}",
            f"--authentication-kubeconfig={kc['controller-manager']}",
            f"--authorization-kubeconfig={kc['controller-manager']}",
            "--bind-address=127.0.0.1", f"--secure-port={kcm_port}", "--port=0",
            f"--cert-dir={self.dir / 'kcm-certs'}",
            "--controllers=*", "--use-service-account-credentials=false", "--leader-elect=false",
            f"--service-account-private-key-file={pki / 'sa.key'}", f"--root-ca-file={pki / 'ca.crt'}",
            "--allocate-node-cidrs=false", "--profiling=false", "--v=1"])

        runner_env = self._env({"PYTHONPATH": os.pathsep.join(
            [str(PACKAGE_PARENT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))})
        policy_flags = []
        if self.enforce_network_policy:
            reason = podnet.unavailable(self.nft)
            self.network_policy = reason or "enforced"
            if reason is None:
                policy_flags = ["--network-policy-nft", self.nft, "--rig-id", self.id]
        else:
            self.network_policy = "not enforced (Rig.enforce_network_policy is off)"
        runner = self._start("pod-runner", [
            sys.executable, "-m", "k8srig.podrunner", "--kubeconfig", str(kc["pod-runner"]),
            "--run-dir", str(self.dir / "runner"), "--node-name", self.node_name,
            "--pod-network", self.pod_network,
            "--backoff-base", str(self.backoff_base_s), "--backoff-cap", str(self.backoff_cap_s),
            *policy_flags], runner_env)

        def node_ready() -> bool:
            self._alive("kube-controller-manager", kcm)
            self._alive("pod-runner", runner)
            node = self.client.get_or_none(CORE["Node"], self.node_name)
            conds = {c["type"]: c["status"] for c in ((node or {}).get("status") or {}).get("conditions") or []}
            return conds.get("Ready") == "True"
        wait_for(node_ready, timeout_s=self.startup_timeout_s, what=f"node {self.node_name} Ready")

        def default_sa_token() -> bool:   # pods cannot be admitted before the default SA has its token
            self._alive("kube-controller-manager", kcm)
            sa = self.client.get_or_none(CORE["ServiceAccount"], "default", "default")
            return bool(sa and sa.get("secrets"))
        wait_for(default_sa_token, timeout_s=self.startup_timeout_s, what="default ServiceAccount token")
        self.timings["ready_s"] = time.monotonic() - t0

    # --- an API server outage -------------------------------------------------------------------------------
    def stop_apiserver(self, grace_s: float = 10.0) -> None:
        """Stop kube-apiserver alone (SIGTERM, then SIGKILL after grace_s); etcd, the controller-manager, the
        pod runner and the pods keep running, and every client sees connections refused until
        start_apiserver()."""
        proc = dict(self._procs).get("kube-apiserver")
        if proc is None or proc.poll() is not None:
            raise RuntimeError("kube-apiserver is not running")
        procs.stop_group(proc, grace_s)
        self._procs.remove(("kube-apiserver", proc))

    @property
    def apiserver_stopped(self) -> bool:
        """Whether stop_apiserver() stopped it and it was not started again."""
        return bool(self._apiserver_argv) and "kube-apiserver" not in dict(self._procs)

    def start_apiserver(self) -> float:
        """Start kube-apiserver with the same flags, port, certificates and etcd (so every object, token and
        resourceVersion survives) and wait for /readyz; returns the seconds that took."""
        if not self._apiserver_argv:
            raise RuntimeError("the rig was never started")
        if (proc := dict(self._procs).get("kube-apiserver")) is not None and proc.poll() is None:
            raise RuntimeError("kube-apiserver is already running")
        t0 = time.monotonic()
        apiserver = self._start("kube-apiserver", self._apiserver_argv)
        wait_for(lambda: self._alive("kube-apiserver", apiserver) and self.client.raw_get("/readyz", timeout=3)[0] == 200,
                 timeout_s=self.startup_timeout_s, interval_s=0.25, what="kube-apiserver /readyz")
        return time.monotonic() - t0

    # --- stop -----------------------------------------------------------------------------------------------
    def stop(self) -> list[int]:
        """Stop everything this rig started; return PIDs that were still alive afterwards (and were killed)."""
        order = ["pod-runner", "kube-controller-manager", "kube-apiserver", "etcd"]
        by_name = dict(self._procs)
        for name in order:
            proc = by_name.get(name)
            if proc is not None:
                procs.stop_group(proc, 30.0 if name == "pod-runner" else 10.0)
            if name == "pod-runner" and self.dir is not None:
                # Container groups the runner did not get to stop (it was killed, or crashed).
                pgid_dir = self.dir / "runner" / "pgids"
                for f in pgid_dir.iterdir() if pgid_dir.is_dir() else []:
                    if f.name.isdigit():
                        procs.kill_group(int(f.name), signal.SIGKILL)
        leftovers = procs.kill_marked(self.id)
        if self.network_policy == "enforced":
            podnet.cleanup(self.id, self.nft)      # the runner removes both; this covers a killed runner
        self._procs.clear()
        if self._net_lock is not None:
            release_pod_network(self._net_lock, self._net_lock_path)
            self._net_lock = None
        if self.dir is not None:
            marker = self.dir / "etcd-data"
            if marker.exists():
                shutil.rmtree(marker.read_text().strip(), ignore_errors=True)
            if not self.keep_dir:
                shutil.rmtree(self.dir, ignore_errors=True)
        return leftovers

    def __enter__(self) -> "Rig":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
