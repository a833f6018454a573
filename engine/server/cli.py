"""`kvgate serve MODEL`: the engine behind the OpenAI HTTP API."""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from kvgate.engine.server.lifecycle import DrainingServer


def add_serve_parser(sub) -> None:
    from kvgate.engine.cli_args import add_engine_args
    from kvgate.engine.config import DEFAULT_STEP_TIMEOUT_S
    from kvgate.engine.server.auth import API_KEY_ENV
    from kvgate.engine.server.limits import _positive_float, add_limit_args
    from kvgate.engine.server.response_store import add_store_args
    from kvgate.engine.server.reasoning_parsers import REASONING_PARSERS
    from kvgate.engine.server.tool_parsers import TOOL_PARSERS

    p = sub.add_parser("serve", help="serve a model over the OpenAI HTTP API")
    p.add_argument("model", metavar="MODEL", help="a local HF model folder, or 'demo' (any name with --backend sim)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--engine-loop", choices=["auto", "thread", "process"], default="auto",
                   help="run the engine loop in its own process or in a thread of the server; auto (default): "
                        "process for --backend torch (equal or better throughput and lower tail latency: "
                        "`kvgate bench engine-loop` compares them), thread for sim (its loop mostly sleeps)")
    p.add_argument("--otlp-traces-endpoint", metavar="URL", default=None,
                   help="OTLP/gRPC collector for request spans (http://HOST:4317; vLLM's flag); default: "
                        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT, else no tracing")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds running requests may take to finish (new ones get 503, /health "
                        "503) before they are failed and the server exits; 0: at once (vLLM's flag; default 30)")
    p.add_argument("--keep-alive-on-engine-death", action="store_true",
                   help="stay up (every answer 503, /live 503) when the engine loop dies, instead of exiting "
                        "with status 1 (vLLM: VLLM_KEEP_ALIVE_ON_ENGINE_DEATH)")
    p.add_argument("--engine-step-timeout", type=_positive_float, default=DEFAULT_STEP_TIMEOUT_S, metavar="SECONDS",
                   help="while requests wait, an engine loop that completes no step for this long is hung (a "
                        "deadlocked kernel) and treated as dead: requests get 503, the server exits (or with "
                        "--keep-alive-on-engine-death answers 503 everywhere) (vLLM: "
                        f"VLLM_ENGINE_ITERATION_TIMEOUT_S; default {DEFAULT_STEP_TIMEOUT_S:g})")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='serve tool_choice "auto" (the default when a chat request has tools): the model writes '
                        "calls in its own syntax, read by --tool-call-parser (vLLM's flags; default off: a 400)")
    p.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="the model's tool-call syntax, for --enable-auto-tool-choice (vLLM's names: "
                        f"{', '.join(sorted(TOOL_PARSERS))}; docs/engine.md shows each family's format)")
    p.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="split a thinking model's <think>...</think> text from its answer, into the chat message's "
                        f"reasoning / reasoning_content (vLLM's flag and names: {', '.join(sorted(REASONING_PARSERS))}"
                        "; default: not split)")
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="the chat template of every chat request and of /tokenize with messages, instead of the "
                        "model's (a model without one then serves chats): a Jinja file, or the template itself "
                        "(a value that names no file and has '{', '}' or a newline). Checked at start: a path that "
                        "cannot be read, a template that does not compile, or one over 1 MiB exits with status 2. "
                        "A chat_template in a request still needs --trust-request-chat-template (vLLM's flag)")
    p.add_argument("--response-role", type=_role, default="assistant", metavar="ROLE",
                   help="the role chat answers name when the request's add_generation_prompt is true (the "
                        "default); when false, the answer continues the last message and names its role (vLLM's "
                        "flag; default assistant)")
    p.add_argument("--print-config", action="store_true",
                   help="print every engine setting with its source (given, or why it was derived from the device "
                        "and the model) and the weights' size, and exit without serving; reads the model's "
                        "config.json and safetensors headers but not its weights, and allocates no KV cache (on CUDA, "
                        "unless the KV cache's size is given, the memory profile's forward runs on uninitialised "
                        "weights)")
    p.add_argument("--api-key", nargs="+", action="extend", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' with one of these keys on every request but GET /health, "
                        "/live and /metrics (else 401); repeatable (vLLM's flag). Prefer the environment variable "
                        f"{API_KEY_ENV} (one key; in Kubernetes, from a Secret): a flag's value shows in the process "
                        f"list and the pod spec. The flag wins over {API_KEY_ENV}; an empty {API_KEY_ENV} is unset")
    p.add_argument("--require-api-key", action="store_true",
                   help=f"exit with status 2 unless --api-key or a non-empty {API_KEY_ENV} gives a key, rather than "
                        "serve without one (the operator sets it with spec.engine.apiKeySecretRef: an empty Secret "
                        "value then fails the pod instead of opening it)")
    p.add_argument("--uvicorn-log-level", default="warning")
    add_limit_args(p)
    add_store_args(p)
    add_engine_args(p)
    p.set_defaults(func=run_serve)


class BuiltServer(NamedTuple):
    """What `kvgate serve` runs: the uvicorn server over the app, and what to close and report after it stops."""
    server: "DrainingServer"
    served: str  # the served model name
    tracing: object | None  # the tracing provider, shut down after the server stops
    fatal: list  # the engine's fatal error, once it has one


def run_serve(args: argparse.Namespace) -> int:
    built = build_server(args)
    if isinstance(built, int):
        return built
    logging.getLogger("kvgate").info("serving %s on http://%s:%d", built.served, args.host, args.port)
    return serve_built(built)


def serve_built(built: BuiltServer, sockets: list | None = None) -> int:
    """Run the server until it exits (on --host/--port, or on already bound listening `sockets`); the exit status."""
    built.server.run(sockets=sockets)
    if built.tracing is not None:
        built.tracing.shutdown()  # the spans still queued go out (bounded by the export timeout)
    if built.fatal:
        print(f"kvgate serve: error: {built.fatal[0]}", file=sys.stderr)
        return 1
    return 0


def build_server(args: argparse.Namespace) -> BuiltServer | int:
    """The engine and the app over it, from `kvgate serve`'s flags, not yet serving; or the exit status of a start
    refused (or of --print-config)."""
    from kvgate.common.errors import ConfigError
    from kvgate.engine.server.auth import API_KEY_ENV, resolve_api_keys

    # First: a key that cannot work stops the start before a model is resolved or loaded. Start errors are
    # ConfigErrors: `kvgate` prints them as one line and exits 2.
    api_keys = resolve_api_keys(args.api_key)
    if args.require_api_key and not api_keys:
        raise ConfigError(f"--require-api-key: no key given (--api-key, or a non-empty {API_KEY_ENV})")
    from kvgate.common.tracing import setup as setup_tracing

    tracing = setup_tracing("kvgate-engine", args.otlp_traces_endpoint)  # a bad OTEL_* setting stops it here too

    import uvicorn

    from kvgate.engine.async_llm import AsyncLLM
    from kvgate.engine.cli_args import engine_config_from_args
    from kvgate.engine.generation_defaults import load_generation_defaults
    from kvgate.engine.llm import resolve_model_path
    from kvgate.engine.server.app import create_app
    from kvgate.engine.server.lifecycle import FINAL_GRACE_SECONDS, DrainingServer, start_drain
    from kvgate.engine.server.limits import limits_from_args
    from kvgate.engine.server.response_store import store_from_args

    error = _parser_name_error(args.tool_call_parser, args.reasoning_parser)
    if error:
        print(f"kvgate serve: error: {error}", file=sys.stderr)
        return 2
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        print("kvgate serve: error: --enable-auto-tool-choice and --tool-call-parser go together", file=sys.stderr)
        return 2
    chat_template = None
    if args.chat_template is not None:  # before the model is built or loaded: a bad template fails at once
        from kvgate.engine.server.chat_template import load_server_template

        chat_template = load_server_template(args.chat_template)
        logging.getLogger("kvgate").info("chat template from --chat-template (%d characters), replacing the "
                                         "model's", len(chat_template))
    model_path = args.model if args.backend == "sim" else resolve_model_path(args.model)
    config = engine_config_from_args(model_path, args)
    served = args.served_model_name or args.model
    config.served_model_name = served
    if config.quantization is not None and args.backend == "torch":
        # a --quantization that is not the checkpoint's stops the server before it starts (a ConfigError: exit 2)
        from kvgate.engine.loader import load_hf_config
        from kvgate.engine.quantization import quant_config_from_hf

        quant_config_from_hf(load_hf_config(model_path), config.quantization)
    if args.print_config:
        return print_config(config)
    # read and checked before the model loads: a bad file or override stops the server at once
    generation_defaults = load_generation_defaults(model_path, config.generation_config,
                                                   config.override_generation_config)
    engine_loop = args.engine_loop
    if engine_loop == "auto":
        engine_loop = "process" if args.backend == "torch" else "thread"
    llm = AsyncLLM(config, engine_loop, step_timeout=args.engine_step_timeout)
    if args.shutdown_timeout < 0:
        print("kvgate serve: error: --shutdown-timeout must be >= 0", file=sys.stderr)
        return 2
    fatal: list[BaseException] = []
    server: DrainingServer | None = None

    def on_fatal(exc: BaseException) -> None:
        """The engine failed to start, or its loop died: every in-flight request has had its error."""
        fatal.append(exc)
        if server is not None and not (args.keep_alive_on_engine_death and llm.info is not None):
            server.should_exit = True

    app = create_app(llm, served, limits_from_args(args), on_fatal, server_id=f"{args.host}:{args.port}",
                     tool_parser=args.tool_call_parser, chat_template=chat_template,
                     response_role=args.response_role, generation_defaults=generation_defaults,
                     api_keys=api_keys, tracing=tracing, response_store=store_from_args(args),
                     reasoning_parser=args.reasoning_parser)
    # httptools + uvloop, named rather than left to uvicorn's "auto" (which falls back to pure-Python h11 and asyncio
    # without a word): every EPP scrapes every replica every 50 ms, and in `--backend sim` the server shares the
    # GIL with the engine loop, so the server's CPU per request is the engine's loss (`kvgate bench routing
    # --workloads no-reuse --rates saturation --gateway-cpus 0` shows it).
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                           timeout_graceful_shutdown=FINAL_GRACE_SECONDS, access_log=False,
                                           http="httptools", loop="uvloop"),
                            args.shutdown_timeout, functools.partial(start_drain, app.state.server))
    return BuiltServer(server, served, tracing, fatal)


def _parser_name_error(tool_call_parser: str | None, reasoning_parser: str | None) -> str | None:
    """Why a parser name cannot be served (None: both are known or unset)."""
    from kvgate.engine.server.reasoning_parsers import REASONING_PARSERS
    from kvgate.engine.server.tool_parsers import TOOL_PARSERS

    for flag, name, known in (("--tool-call-parser", tool_call_parser, TOOL_PARSERS),
                              ("--reasoning-parser", reasoning_parser, REASONING_PARSERS)):
        if name is not None and name not in known:
            return f"{flag} {name!r} is not one of: {', '.join(sorted(known))}"
    return None


def _role(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def print_config(config) -> int:
    """`kvgate serve --print-config`: the settings the engine would start with, and where each came from."""
    from kvgate.common.errors import EngineError
    from kvgate.engine.llm_engine import resolve_config

    try:
        loaded, *_ = resolve_config(config, read_weights=False)
    except EngineError as exc:
        print(f"kvgate serve: error: {exc}", file=sys.stderr)
        return 1
    loaded.runner.close()
    print("\n".join(loaded.settings.lines()))
    return 0
