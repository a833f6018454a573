"""`kvgate up`: the whole local stack starts, serves through its gateway port and stops cleanly."""

import errno
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.procs import KVGATE, free_port, stop_group

pytestmark = pytest.mark.processes


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


def still_running(pids: set[int], within_s: float) -> list[int]:
    """Which of `pids` are still running (zombies count as ended) after waiting up to `within_s` for them."""
    deadline = time.monotonic() + within_s
    while True:
        left = []
        for pid in pids:
            try:
                if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
                    left.append(pid)
            except OSError:
                pass
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def start_up(tmp_path, port: int, *args: str) -> subprocess.Popen:
    """`kvgate up --replicas 2 --port PORT ARGS` in its own session (the caller stops it)."""
    env = dict(os.environ, KVGATE_CACHE_DIR=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    return subprocess.Popen([KVGATE, "up", "--replicas", "2", "--port", str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)


def read_until_up(proc: subprocess.Popen, timeout_s: float) -> str:
    """What `kvgate up` printed up to its "Ctrl-C stops everything" line (or its exit, or the timeout)."""
    lines = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "Ctrl-C stops everything" in line:
            break
    return "".join(lines)


@pytest.mark.parametrize("backend, profile", [("sim", "upstream"), ("torch", None)])
def test_up_serves_and_stops(tmp_path, backend, profile):
    """`make up`'s stack (the demo model on the torch backend, kvgate's profile by default) and upstream's
    profile on sim engines."""
    port = free_port()
    proc = start_up(tmp_path, port, "--backend", backend, *(["--profile", profile] if profile else []))
    try:
        output = read_until_up(proc, 240)
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
        # every child ends (kvgate.common.reaper, a child too, ends within its grace once the supervisor has exited)
        left = still_running(children, 5.0)
        assert not left, left
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_up_restarts_a_dead_replica_and_keeps_serving(tmp_path):
    """A replica SIGKILLed under `kvgate up`: requests keep being served by the other one (the EPP takes the dead
    one out), the replica is restarted on its port (logged), serves again, and the stack stops only on SIGTERM."""
    port = free_port()
    proc = start_up(tmp_path, port, "--backend", "sim")
    url = f"http://127.0.0.1:{port}/v1/completions"

    def complete(i):
        r = httpx.post(url, json={"model": "demo", "prompt": f"p{i}", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
        return r.headers["x-kvgate-endpoint"]

    try:
        read_until_up(proc, 240)
        engines = [pid for pid in descendants(proc.pid) if "serve" in open(f"/proc/{pid}/cmdline").read()]
        assert len(engines) == 2
        victim = engines[0]
        victim_port = re.search(r"--port\x00(\d+)", open(f"/proc/{victim}/cmdline").read()).group(1)
        assert len({complete(i) for i in range(20)}) == 2
        os.kill(victim, signal.SIGKILL)
        time.sleep(0.5)  # two failed scrapes take it out of the EPP's rotation
        served = set()
        for i in range(100, 120):  # until the restarted replica answers (after 1 s, sooner than 20 requests on a
            try:                   # loaded machine): then it may serve again
                httpx.get(f"http://127.0.0.1:{victim_port}/health", timeout=0.5)
                break
            except httpx.HTTPError:
                served.add(complete(i))
        assert served and all(not s.endswith(":" + victim_port) for s in served)
        assert proc.poll() is None  # the stack keeps running
        deadline = time.monotonic() + 30
        while not any(s.endswith(":" + victim_port) for s in {complete(i) for i in range(200, 210)}):
            assert time.monotonic() < deadline, "the restarted replica never served again"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=60)[0]
        assert re.search(r"engine-\d exited with code -9 .*; restarting in 1 s", rest), rest
        assert re.search(r"engine-\d restarted \(restart 1\)", rest), rest
        assert proc.returncode == 0 and "stopped" in rest
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_supervise_backs_off_and_resets_after_a_stable_run(tmp_path):
    from kvgate.stack.supervisor import Stack

    stack = Stack(tmp_path)
    stack.start("crasher", [sys.executable, "-c", "import sys; sys.exit(3)"])
    stack.children[0].proc.wait(timeout=10)
    t = stack.children[0].started_at
    delays = []
    for _ in range(7):  # each death doubles the wait, up to the cap
        (line,) = stack.supervise(t)
        delays.append(float(re.search(r"restarting in ([\d.]+) s", line).group(1)))
        t = stack.children[0].restart_at
        assert stack.supervise(t) == [f"crasher restarted (restart {len(delays)})"]
        stack.children[0].proc.wait(timeout=10)
    assert delays == [1, 2, 4, 8, 16, 30, 30]
    (line,) = stack.supervise(t + Stack.STABLE_S)  # it had stayed up a minute: back to the first delay
    assert "restarting in 1 s" in line and "code 3" in line
    stack.stop()


def test_a_stacks_ports_are_held_for_its_children_until_it_stops(tmp_path):
    """A port reserved for a child (`kvgate up` reserves every port it hands out) is refused to another process
    from the moment it is chosen — a racing bind fails, where free_port() left it open until the child bound it,
    which lost a torch engine its port once on a busy machine — while the child, and its restart on the same
    port, listen and serve on it; stop() frees it."""
    from kvgate.stack.supervisor import Stack

    def bind(port: int) -> None:  # another process's listener (no SO_REUSEADDR: nothing of ours in TIME_WAIT)
        with socket.socket() as other:
            other.bind(("127.0.0.1", port))

    stack = Stack(tmp_path)
    try:
        port = stack.reserve_port()
        with pytest.raises(OSError) as refused:  # before the child has started
            bind(port)
        assert refused.value.errno == errno.EADDRINUSE
        stack.start("engine", [KVGATE, "serve", "demo", "--backend", "sim", "--port", str(port)])
        stack.wait_http(f"http://127.0.0.1:{port}/health", time.monotonic() + 60, "the engine")
        stack.children[0].proc.kill()
        stack.children[0].proc.wait(timeout=10)
        (died,) = stack.supervise()
        assert "restarting in 1 s" in died
        assert stack.supervise(stack.children[0].restart_at) == ["engine restarted (restart 1)"]
        stack.wait_http(f"http://127.0.0.1:{port}/health", time.monotonic() + 60, "the restarted engine")
    finally:
        stack.stop()
    bind(port)  # free again


@pytest.mark.parametrize("how", ["kv-events", "default"])
def test_up_with_kv_events_feeds_the_precise_scorer_from_every_engine(tmp_path, how):
    """`kvgate up --kv-events` with a config naming precise-prefix-cache-scorer, or by default (kvgate's profile,
    which turns the events on): every engine publishes on its own loopback sockets, the EPP subscribes to each,
    and the blocks the engines cache reach the EPP's index (a stack whose engines connect instead of bind, or
    whose EPP is told no socket, shows 0 blocks)."""
    from kvgate.bench.routing.configurations import BY_NAME

    config = tmp_path / "precise.yaml"
    config.write_text(BY_NAME["precise"].epp_config)
    port = free_port()
    args = ["--kv-events", "--config-file", str(config)] if how == "kv-events" else []
    proc = start_up(tmp_path, port, "--backend", "sim", *args)
    try:
        output = read_until_up(proc, 120)
        metrics_url = re.search(r"EPP metrics: (\S+)", output)
        assert metrics_url, output
        system = "You are a careful assistant for tenant seven. " * 20  # ~60 blocks of 16 bytes
        for i in range(8):
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                           json={"model": "demo", "prompt": system + f"question {i}", "max_tokens": 2}, timeout=60)
            assert r.status_code == 200, r.text

        def metric(text: str, name: str) -> float:
            return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))

        deadline = time.monotonic() + 20
        while True:
            text = httpx.get(metrics_url.group(1), timeout=5).text
            stored = metric(text, 'kvgate_epp_kv_events_total\\{event="blocks_stored"\\}')
            # the event counter is live; the index gauge comes from a snapshot the EPP publishes up to 1 s later
            if (stored > 0 and metric(text, "kvgate_epp_precise_index_blocks") > 0) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert metric(text, "kvgate_epp_kv_events_subscribed_endpoints") == 2, text
        assert stored >= len(system) // 16, text  # the shared prefix's blocks, announced by the engine(s) that ran it
        assert metric(text, "kvgate_epp_precise_index_blocks") > 0, text
        from kvgate.bench.routing.runner import epp_kv_event_counts  # what `kvgate bench routing` records

        counts = epp_kv_event_counts(int(metrics_url.group(1).rsplit(":", 1)[1].split("/")[0]))
        assert counts["blocks_stored"] >= stored and counts["gaps"] == 0, counts
    finally:
        stop_group(proc, timeout=60)  # kvgate up stops everything on SIGTERM as on Ctrl-C


def test_the_epp_tokenizes_with_the_engines_model_folder(tmp_path):
    """With KV events (`--profile kvgate`, `--kv-events`) the EPP must hash prompts with the engines' tokenizer:
    a local model folder is passed as --tokenizer; the demo model and the sim's model names use the byte
    tokenizer the EPP defaults to; an explicit --tokenizer wins."""
    from kvgate.stack.local_stack import epp_tokenizer_args

    folder = tmp_path / "model"
    folder.mkdir()
    assert epp_tokenizer_args(str(folder), True) == ["--tokenizer", str(folder.resolve())]
    assert epp_tokenizer_args(str(folder), False) == []
    assert epp_tokenizer_args("demo", True) == [] and epp_tokenizer_args("sim-model", True) == []
    assert epp_tokenizer_args(str(folder), True, ["--tokenizer", "/elsewhere"]) == []
