"""What one client may ask of the server: every bound on a request, with its flag and its default.

Each limit is finite by default (a hostile or broken client cannot make the server do unbounded work) and
is answered with an OpenAI-shaped 400 (413 for the body) naming the limit and its flag. The defaults are
generous for real clients: OpenAI's own API allows n <= 128, at most 4 stop sequences and 20 top logprobs.
Flag names follow vLLM where vLLM has the knob (`--max-logprobs`, `--max-queued-requests`,
`--trust-request-chat-template`); vLLM leaves the others unbounded.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvgate.engine.sampling_params import MAX_LOGPROBS


@dataclass(frozen=True)
class RequestLimits:
    max_request_body_bytes: int = 8 * 2**20  # 413 beyond; 8 MiB holds a 128k-token prompt as text or ids
    max_n: int = 128  # n and best_of
    max_prompts_per_request: int = 256  # prompts in one /v1/completions call
    max_logprobs: int = MAX_LOGPROBS  # logprobs / top_logprobs (vLLM's --max-logprobs, default 20)
    max_stop_sequences: int = 64  # entries of `stop` and of `stop_token_ids`, each
    max_stop_sequence_chars: int = 1024  # length of one stop string
    # entries of logit_bias (each also a token id of the vocabulary); vLLM takes any number up to the vocabulary
    max_logit_bias: int = 1024
    # prompt tokens (over a request's prompts x n) whose logprobs completions' echo returns: each costs a log-softmax
    # over the vocabulary and logprobs + 1 entries of the answer. vLLM has no bound; 131072 is 128 prompts of 1k
    # tokens, an evaluation harness's large batch.
    max_prompt_logprob_tokens: int = 131072
    # engine requests (prompts x n) waiting for a batch slot: 503 beyond (vLLM's flag; vLLM has no default
    # bound). 1024 is 8 full batches of the default --max-num-seqs 128.
    max_queued_requests: int = 1024
    tokenize_timeout: float = 10.0  # seconds to tokenize / render one request's prompts, off the event loop
    trust_request_chat_template: bool = False  # a `chat_template` in the body is refused unless set
    # seconds a response may wait for a client that reads nothing before it is cut and its request aborted
    client_stall_timeout: float = 30.0


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    d = RequestLimits()
    g = parser.add_argument_group("request limits (each answered with 400, the body with 413)")
    g.add_argument("--max-request-body-bytes", type=_positive_int, default=d.max_request_body_bytes,
                   help=f"largest request body in bytes; 413 beyond (default {d.max_request_body_bytes})")
    g.add_argument("--max-n", type=_positive_int, default=d.max_n,
                   help=f"largest n (and best_of) of one request (default {d.max_n})")
    g.add_argument("--max-prompts-per-request", type=_positive_int, default=d.max_prompts_per_request,
                   help=f"most prompts in one completions request (default {d.max_prompts_per_request})")
    g.add_argument("--max-logprobs", type=_bounded_int(0, MAX_LOGPROBS), default=d.max_logprobs,
                   help=f"largest logprobs / top_logprobs (default and most: {MAX_LOGPROBS})")
    g.add_argument("--max-stop-sequences", type=_positive_int, default=d.max_stop_sequences,
                   help=f"most entries in stop and in stop_token_ids (default {d.max_stop_sequences})")
    g.add_argument("--max-stop-sequence-chars", type=_positive_int, default=d.max_stop_sequence_chars,
                   help=f"longest stop string (default {d.max_stop_sequence_chars})")
    g.add_argument("--max-logit-bias", type=_positive_int, default=d.max_logit_bias,
                   help=f"most entries in logit_bias (default {d.max_logit_bias})")
    g.add_argument("--max-prompt-logprob-tokens", type=_positive_int, default=d.max_prompt_logprob_tokens,
                   help="most prompt tokens (over a completions request's prompts x n) whose logprobs echo with "
                        f"logprobs returns (default {d.max_prompt_logprob_tokens})")
    g.add_argument("--max-queued-requests", type=_positive_int, default=d.max_queued_requests,
                   help="answer 503 when a request would make more than this many engine requests "
                        f"(prompts x n) wait for a batch slot (default {d.max_queued_requests})")
    g.add_argument("--tokenize-timeout", type=_positive_float, default=d.tokenize_timeout,
                   help="seconds to tokenize or render one request's prompts (done in a thread pool, off the "
                        f"event loop); 400 beyond (default {d.tokenize_timeout:g})")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a chat_template in the request body (default: refused with 400, as vLLM does)")
    g.add_argument("--client-stall-timeout", type=_positive_float, default=d.client_stall_timeout,
                   help="seconds a response waits for a client that reads nothing (its socket buffers full) "
                        "before the response is cut and its generation aborted, freeing its KV blocks "
                        f"(default {d.client_stall_timeout:g})")


def limits_from_args(args: argparse.Namespace) -> RequestLimits:
    return RequestLimits(
        max_request_body_bytes=args.max_request_body_bytes, max_n=args.max_n,
        max_prompts_per_request=args.max_prompts_per_request, max_logprobs=args.max_logprobs,
        max_stop_sequences=args.max_stop_sequences, max_stop_sequence_chars=args.max_stop_sequence_chars,
        max_logit_bias=args.max_logit_bias, max_prompt_logprob_tokens=args.max_prompt_logprob_tokens,
        max_queued_requests=args.max_queued_requests, tokenize_timeout=args.tokenize_timeout,
        trust_request_chat_template=args.trust_request_chat_template,
        client_stall_timeout=args.client_stall_timeout,
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _bounded_int(low: int, high: int):
    def parse(text: str) -> int:
        value = int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {value}")
        return value

    return parse
