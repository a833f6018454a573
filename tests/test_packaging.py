"""The repository's folder names must not shadow real packages when the repo root is on sys.path."""

import importlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_no_shadowing_of_stdlib_operator_or_the_envoy_packages():
    code = ("import sys; sys.path.insert(0, %r); import operator, envoy.service.ext_proc.v3, kvgate.epp, "
            "kvgate.engine; print(operator.__file__); print(envoy.__file__)") % str(ROOT)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    operator_file, envoy_file = out.stdout.split()
    assert Path(operator_file).parent != ROOT / "operator" and Path(envoy_file).parent != ROOT / "envoy"
    assert "site-packages" in envoy_file
    # envoy/ is data only, and operator/ is kvgate.operator only: with an __init__.py either would win over
    # xds-protos' `envoy` / the standard `operator` whenever the checkout is on sys.path
    for folder in ("envoy", "operator"):
        assert not (ROOT / folder / "__init__.py").exists(), f"{folder}/ must not become a top-level package"


def test_python_m_from_the_checkout_keeps_the_standard_operator():
    # `python -m pip` in a fresh venv, run from the checkout: nothing has imported `operator` yet when the
    # checkout is put first on sys.path (-S reproduces that: no site, no .pth files).
    code = "import sys; sys.path.insert(0, %r); import collections, operator; print(operator.__file__)" % str(ROOT)
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).parent != ROOT / "operator"


def test_the_distribution_has_one_top_level_package():
    import tomllib

    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert all(p == "kvgate" or p.startswith("kvgate.") for p in tool["packages"])
    assert set(tool["package-dir"]) == set(tool["packages"])  # operator/ is only ever kvgate.operator


def test_namespace_mapping():
    for name in ("kvgate.engine", "kvgate.engine.server", "kvgate.epp", "kvgate.epp.scheduling.plugins"):
        module = importlib.import_module(name)
        assert Path(module.__file__).resolve().is_relative_to(ROOT)
