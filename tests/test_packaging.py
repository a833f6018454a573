"""The repository's folder names must not shadow real packages when the repo root is on sys.path."""

import importlib
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.processes
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


@pytest.mark.processes
def test_python_m_from_the_checkout_keeps_the_standard_operator():
    # `python -m pip` in a fresh venv, run from the checkout: nothing has imported `operator` yet when the
    # checkout is put first on sys.path (-S reproduces that: no site, no .pth files).
    code = "import sys; sys.path.insert(0, %r); import collections, operator; print(operator.__file__)" % str(ROOT)
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).parent != ROOT / "operator"


def test_the_distribution_has_one_top_level_package():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert all(p == "kvgate" or p.startswith("kvgate.") for p in tool["packages"])
    assert set(tool["package-dir"]) == set(tool["packages"])  # operator/ is only ever kvgate.operator


def test_namespace_mapping():
    for name in ("kvgate.engine", "kvgate.engine.server", "kvgate.epp", "kvgate.epp.scheduling.plugins"):
        module = importlib.import_module(name)
        assert Path(module.__file__).resolve().is_relative_to(ROOT)


# --- the Docker image's file set installs -------------------------------------------------------------------

def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction: comments dropped, backslash continuations joined."""
    out, current = [], ""
    for line in text.splitlines():
        if not current and line.lstrip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        current += line
        if current.strip():
            word, _, rest = current.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
        current = ""
    return out


def dockerignore_patterns(root: Path) -> list[tuple[bool, re.Pattern]]:
    """.dockerignore as (exclude?, regex) in order; the last matching pattern wins (Docker's rules: patterns
    are anchored at the context root, `**` spans folders, `!` re-includes)."""
    path = root / ".dockerignore"
    patterns = []
    for line in (path.read_text().splitlines() if path.exists() else []):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        exclude = not line.startswith("!")
        glob = line.lstrip("!").strip("/")
        regex = ""
        i = 0
        while i < len(glob):
            if glob.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif glob.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif glob[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif glob[i] == "?":
                regex, i = regex + "[^/]", i + 1
            else:
                regex, i = regex + re.escape(glob[i]), i + 1
        patterns.append((exclude, re.compile(regex + r"\Z")))
    return patterns


def ignored(relative: str, patterns) -> bool:
    """A path is ignored when the last pattern matching it or one of its parent folders excludes it."""
    parts = relative.split("/")
    verdict = False
    for exclude, regex in patterns:
        if any(regex.match("/".join(parts[:n])) for n in range(1, len(parts) + 1)):
            verdict = exclude
    return verdict


def docker_build_files(root: Path) -> tuple[dict[str, Path], str]:
    """{path under the install folder: source file} for the COPYs before the image's `pip install .`, and that
    RUN line; the COPY destinations must be relative to the WORKDIR the install runs in."""
    files: dict[str, Path] = {}
    patterns = dockerignore_patterns(root)
    for instruction, args in dockerfile_instructions((root / "Dockerfile").read_text()):
        if instruction == "WORKDIR":
            files.clear()  # only what is copied into the install's own folder counts
        elif instruction == "COPY":
            words = json.loads(args) if args.startswith("[") else args.split()
            words = [w for w in words if not w.startswith("--")]
            assert not any(w.startswith("--from") for w in args.split()), "COPY --from is not modelled here"
            *sources, dest = words
            assert not dest.startswith("/"), f"COPY {args}: expected a destination relative to the WORKDIR"
            dest = dest.rstrip("/").removeprefix("./").removeprefix(".")
            for source in sources:
                src = root / source
                assert src.exists(), f"COPY {args}: {source} does not exist"
                if src.is_dir():
                    for f in sorted(src.rglob("*")):
                        rel = f.relative_to(root).as_posix()
                        if f.is_file() and not ignored(rel, patterns):
                            files["/".join(p for p in (dest, f.relative_to(src).as_posix()) if p)] = f
                elif not ignored(source, patterns):
                    target = dest if len(sources) == 1 and not words[-1].endswith("/") and dest else \
                        "/".join(p for p in (dest, src.name) if p)
                    files[target] = src
        elif instruction == "RUN" and "pip install" in args and re.search(r"\s\.(\s|$)", args):
            return files, args
    raise AssertionError("the Dockerfile has no `RUN pip install ... .`")


def test_dockerignore_rules():
    patterns = dockerignore_patterns(ROOT)
    assert ignored("tests/test_packaging.py", patterns) and ignored("epp/__pycache__/x.pyc", patterns)
    assert not ignored("epp/main.py", patterns) and not ignored("conformance/manifests/base.yaml", patterns)


@pytest.mark.processes
def test_the_docker_images_file_set_installs_and_runs(tmp_path):
    """Exactly what the Dockerfile copies, pip-installed offline into a fresh venv: every kvgate package
    imports and `kvgate --help` runs (a folder the Dockerfile forgets fails here, not at `docker build`)."""
    import site
    import sysconfig

    files, run = docker_build_files(ROOT)
    src = tmp_path / "src"
    for rel, source in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, src / rel)

    venv = tmp_path / "venv"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(venv)],
                   check=True, timeout=60)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    # The dependencies (and pip, setuptools for the build) come from this interpreter's site-packages, added
    # as plain path entries: their .pth files (this checkout's editable kvgate) are not run there.
    deps = [p for p in dict.fromkeys([*site.getsitepackages(), sysconfig.get_paths()["purelib"], *sys.path])
            if p.endswith("site-packages") and Path(p).is_dir()]
    (Path(purelib) / "zz_test_deps.pth").write_text("\n".join(deps) + "\n")
    install = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                              "--no-cache-dir", "--disable-pip-version-check", "-q", str(src)],
                             capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert install.returncode == 0, f"pip install of the Dockerfile's files failed:\n{install.stderr[-3000:]}"

    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    for required in ("kvgate.engine", "kvgate.epp", "kvgate.operator", "kvgate.conformance"):
        assert required in packages
    code = ("import importlib, json, sys\n"
            "mods = [importlib.import_module(n) for n in sys.argv[1:]]\n"
            "print(json.dumps([list(m.__path__)[0] for m in mods]))\n")
    out = subprocess.run([str(python), "-c", code, *packages], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    for name, folder in zip(packages, json.loads(out.stdout)):
        assert Path(folder).is_relative_to(purelib), f"{name} imported from {folder}, not from the install"
    check = subprocess.run([str(python), "-c", "from importlib.resources import files; "
                            "print(len(list(files('kvgate.conformance').joinpath('manifests').iterdir())))"],
                           capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert check.returncode == 0 and int(check.stdout) > 1, check.stderr
    help_run = subprocess.run([str(venv / "bin" / "kvgate"), "--help"], capture_output=True, text=True,
                              timeout=120, cwd=tmp_path)
    assert help_run.returncode == 0, help_run.stderr[-3000:]
    for command in ("serve", "epp", "operator"):
        assert command in help_run.stdout
