"""Error bodies in each client API's own shape: OpenAI's (`{"error": {"message", "type", "param", "code"}}`, every
path but Anthropic's) and Anthropic's Messages API (`{"type": "error", "error": {"type", "message"}}`, on
/v1/messages). Shared by the engine server (engine/server/anthropic_errors.py reshapes its answers) and the EPP
(its ImmediateResponse refusals), so a client hears the same shape whichever part refused it."""

from __future__ import annotations

ANTHROPIC_PATH = "/v1/messages"

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors); anything else 5xx is api_error
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    422: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error",
                    529: "overloaded_error"}


def is_anthropic_path(path: str) -> bool:
    """Whether a request path (query string and all) is the Anthropic Messages API's."""
    path = path.split("?", 1)[0]
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def anthropic_error_type(status: int) -> str:
    return _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}
