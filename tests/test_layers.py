"""The import layers of docs/architecture.md hold: each package imports only the packages below it (every import
statement counts, those inside functions too), and the EPP's and the operator's entry points never load torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Folder of the checkout -> the kvgate packages its modules may import (besides their own and the root
# package's `kvgate.__version__`). The table of docs/architecture.md#import-layers, read from the top down.
ALLOWED = {
    "common": set(),
    "engine": {"common"},
    "epp": {"common"},
    "operator": {"common", "epp"},
    "stack": {"common", "engine", "epp"},
    "conformance": {"common", "epp", "operator"},
    "bench": {"common", "engine", "epp", "operator", "stack"},
    "kvgate": {"common", "engine", "epp", "operator", "stack", "conformance", "bench"},
}
PACKAGES = set(ALLOWED)


def imported_packages(path: Path) -> set[tuple[str, int]]:
    """(package folder, line) of each kvgate package a module imports, `from kvgate import X` included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] if node.module != "kvgate" else [f"kvgate.{a.name}" for a in node.names
                                                                if not a.name.startswith("__")]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] != "kvgate" or len(parts) == 1:
                continue
            found.add((parts[1] if parts[1] in PACKAGES else "kvgate", node.lineno))
    return found


def test_every_folder_of_the_package_has_a_layer():
    import tomllib

    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert {d.split("/")[0] for d in package_dirs.values()} == PACKAGES


@pytest.mark.parametrize("folder", sorted(PACKAGES))
def test_a_package_imports_only_the_layers_below_it(folder):
    wrong = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for package, line in imported_packages(path):
            if package != folder and package not in ALLOWED[folder]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports kvgate.{package}")
    assert not wrong, "\n".join(wrong)


def test_no_module_outside_the_cli_imports_the_cli():
    wrong = [f"{p.relative_to(ROOT)}" for folder in PACKAGES - {"kvgate"} for p in (ROOT / folder).rglob("*.py")
             if "kvgate.cli" in p.read_text()]
    assert not wrong, wrong


@pytest.mark.processes  # a fresh interpreter: this one has torch loaded already
@pytest.mark.parametrize("module", ["kvgate.epp.main", "kvgate.operator.main", "kvgate.common.tokenizer_files",
                                    "kvgate.epp.kv_events.tokenize"])
def test_the_epp_and_the_operator_never_import_torch(module):
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"{module} loads torch: {done.stdout}"


@pytest.mark.processes  # a fresh interpreter
def test_the_kvgate_commands_parser_never_imports_torch():
    """Every `kvgate ...` process builds the whole parser before it runs its command: `kvgate epp`, `kvgate
    operator`, `kvgate up` and the benches' drivers must not load torch only to read their flags."""
    code = ("import sys; from kvgate.cli import build_parser; build_parser(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"the kvgate command's parser loads torch: {done.stdout}"
