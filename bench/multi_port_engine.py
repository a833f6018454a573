"""One `kvgate serve` engine listening on N loopback ports: N endpoints for the EPP's pool-scale benches.

A thousand engine processes do not fit on a small machine; a thousand listening sockets served by one real engine
do. This builds exactly the server `kvgate serve` builds (engine/server/cli.py: build_server, from the same flags)
and runs it on N sockets bound here, each 127.0.0.1 on a port of the kernel's choosing. Every endpoint is then a
real `kvgate serve` /metrics page and OpenAI API; they share one engine, so their pages carry the same numbers.

    python -m kvgate.bench.multi_port_engine --count 1000 --ports-file PORTS -- sim-model --backend sim

The ports are written to PORTS (one a line, written whole by a rename) once every socket listens; the server then
runs until SIGTERM, as `kvgate serve` does.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import sys
from pathlib import Path

# file descriptors the launcher needs beyond its listening sockets (the engine, logs, imports)
SPARE_FDS = 256


def raise_fd_limit(needed: int) -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; SystemExit naming both when the hard one is below `needed`.
    Returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise SystemExit(f"the file-descriptor hard limit (RLIMIT_NOFILE {hard}) is below the {needed} this run "
                         f"needs; raise it (ulimit -Hn, or the container's nofile limit) or use fewer endpoints")
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        soft = hard if hard != resource.RLIM_INFINITY else max(soft, needed)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return soft


def bind_sockets(count: int, host: str = "127.0.0.1") -> list[socket.socket]:
    """`count` listening TCP sockets on `host`, each on a free port the kernel picks."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, 0))
            s.listen(2048)
            s.set_inheritable(True)
            sockets.append(s)
    except BaseException:
        for s in sockets:
            s.close()
        raise
    return sockets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvgate.bench.multi_port_engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, required=True, help="listening sockets (endpoints)")
    parser.add_argument("--ports-file", required=True, help="where the ports are written once all listen")
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then `kvgate serve`'s arguments")
    args = parser.parse_args(argv)
    if args.count < 1:
        parser.error("--count must be at least 1")
    serve_argv = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args

    from kvgate.engine.server.cli import add_serve_parser, build_server, serve_built

    serve_parser = argparse.ArgumentParser(prog="kvgate")  # `kvgate serve`'s own flags, as the CLI registers them
    serve_parser.add_argument("--log-level", default="warning")
    add_serve_parser(serve_parser.add_subparsers(dest="command"))
    serve_args = serve_parser.parse_args(["serve", *serve_argv])
    raise_fd_limit(args.count * 3 + SPARE_FDS)  # each socket, and a connection to it from the EPP and from Envoy
    sockets = bind_sockets(args.count, serve_args.host)
    built = build_server(serve_args)
    if isinstance(built, int):
        return built
    ports = Path(args.ports_file)
    partial = ports.with_name(ports.name + ".partial")
    partial.write_text("".join(f"{s.getsockname()[1]}\n" for s in sockets))
    os.replace(partial, ports)  # the sockets listen already: connections queue until the server accepts them
    print(f"serving {built.served} on {args.count} ports of {serve_args.host}", file=sys.stderr, flush=True)
    return serve_built(built, sockets)


if __name__ == "__main__":
    sys.exit(main())
