"""`kvgate up`: the whole local stack starts, serves through its gateway port and stops cleanly."""

import os
import re
import signal
import subprocess
import time

import httpx
import pytest

from tests.procs import KVGATE, free_port


def descendants(pid: int) -> set[int]:
    out = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat[1]) == pid:
            out.add(int(entry))
    for child in list(out):
        out |= descendants(child)
    return out


@pytest.mark.parametrize("backend", ["sim", "torch"])
def test_up_serves_and_stops(tmp_path, backend):
    port = free_port()
    env = dict(os.environ, KVGATE_CACHE_DIR=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([KVGATE, "up", "--replicas", "2", "--backend", backend, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    lines = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "Ctrl-C stops everything" in line:
                break
        output = "".join(lines)
        assert f"http://127.0.0.1:{port}" in output and "curl" in output, output
        children = descendants(proc.pid)
        assert len(children) >= 4  # 2 engines, the EPP, Envoy
        served = set()
        for i in range(6):
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                           json={"model": "demo", "prompt": f"hello {i}", "max_tokens": 5}, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 5
            served.add(r.headers["x-kvgate-endpoint"])
        assert served  # answered by the engines behind the gateway
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=60)[0]
        assert proc.returncode == 0 and "stopped" in rest
        time.sleep(0.5)
        assert not [pid for pid in children if os.path.exists(f"/proc/{pid}")
                    and open(f"/proc/{pid}/stat").read().split()[2] != "Z"]
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_up_stops_everything_when_a_child_dies(tmp_path):
    port = free_port()
    env = dict(os.environ, KVGATE_CACHE_DIR=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([KVGATE, "up", "--replicas", "1", "--backend", "sim", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        for _ in range(200):
            line = proc.stdout.readline()
            if not line or "Ctrl-C" in line:
                break
        children = descendants(proc.pid)
        engine = [pid for pid in children if "serve" in open(f"/proc/{pid}/cmdline").read()][0]
        os.kill(engine, signal.SIGKILL)
        rest = proc.communicate(timeout=60)[0]
        assert proc.returncode == 1 and re.search(r"engine-0 exited", rest), rest
        time.sleep(0.5)
        assert not [pid for pid in children if os.path.exists(f"/proc/{pid}")
                    and open(f"/proc/{pid}/stat").read().split()[2] != "Z"]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
