"""Which reconcile failures are worth a retry, in kopf's terms (its examples/03-exceptions): a
kopf.TemporaryError is retried with a backoff, a kopf.PermanentError is not.

The operator reconciles in its own worker (reconciler.py), outside kopf's handlers, so kopf's retry machinery
never sees these failures; the worker asks `classify` and acts as kopf would:

  temporary — retried with exponential backoff (1 s doubling to 60 s, or the error's own `delay`): the API
      server unreachable or slow (connection refused or reset, timeouts, 408, 429, 5xx), a conflict (409:
      someone else wrote the object in between), an expired credential (401: the client reloads its token);
  permanent — a status condition on the object (reason ReconcileFailed, with the message) and no retry loop:
      the API server refused the request itself (400, 403, 404, 422, ...), or the reconcile failed on its own
      (a spec the validators let through, a bug). A retry would get the same answer; the next watch event or
      resync (every --resync-seconds) looks again, so a fixed spec or a granted permission is picked up.

A permanent failure is logged once per object and message (PermanentFailureLog), not at every resync that meets
it again.
"""

from __future__ import annotations

import logging

import kopf

from kvgate.operator.apply import ApiError

log = logging.getLogger("kvgate.operator")

REASON = "ReconcileFailed"
TEMPORARY_STATUSES = frozenset({401, 408, 409, 429, 500, 502, 503, 504})
MAX_MESSAGE_CHARS = 1000  # a status condition's message


def failure_message(failure: BaseException) -> str:
    """What a permanent failure's status condition says (ReconcileFailed)."""
    return f"the operator cannot reconcile it: {failure}"[:MAX_MESSAGE_CHARS]
# Exceptions of these libraries' own (urllib3's MaxRetryError, ProtocolError ...) are transport failures.
TRANSPORT_MODULES = ("urllib3", "http", "ssl", "socket")


def classify(exc: BaseException) -> kopf.TemporaryError | kopf.PermanentError:
    """`exc` as kopf's TemporaryError (delay None: the worker's backoff) or PermanentError; kopf's own pass
    through. The original is the result's __cause__."""
    if isinstance(exc, (kopf.TemporaryError, kopf.PermanentError)):
        return exc
    if isinstance(exc, ApiError):
        temporary = exc.status in TEMPORARY_STATUSES or not exc.status  # 0: no HTTP answer at all
    else:
        temporary = isinstance(exc, (OSError, TimeoutError)) or \
            type(exc).__module__.split(".")[0] in TRANSPORT_MODULES
    out = kopf.TemporaryError(str(exc), delay=None) if temporary else kopf.PermanentError(str(exc) or repr(exc))
    out.__cause__ = exc
    return out


def is_refusal(failure: kopf.PermanentError) -> bool:
    """Whether a permanent failure is the API server's answer (logged without a traceback) rather than the
    operator's own exception (a traceback: it may be a bug)."""
    return isinstance(failure.__cause__, ApiError)


class PermanentFailureLog:
    """Logs each permanent failure once per memo (a key, or an object) and message: a refusal by the API server
    as a line, anything else with its traceback. `clear` forgets a memo once it reconciles again."""

    def __init__(self) -> None:
        self._logged: dict[tuple, str] = {}  # memo -> the failure last logged for it

    def log(self, key: tuple, failure: kopf.PermanentError, memo: tuple | None = None) -> None:
        memo = memo or key
        if self._logged.get(memo) == str(failure):
            return
        self._logged[memo] = str(failure)
        log.error("reconcile %s failed permanently, not retrying (the next change or resync looks again): %s",
                  "/".join(key), failure, exc_info=None if is_refusal(failure) else (failure.__cause__ or failure))

    def clear(self, memo: tuple) -> None:
        self._logged.pop(memo, None)
