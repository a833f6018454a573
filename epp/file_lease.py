"""A Lease on one machine, for leader election without a Kubernetes API server (`kvgate epp --ha-lease-file`:
`kvgate up`, benchmarks): the three calls common/lease_election.py's LeaseElector makes on a CoordinationV1Api —
read, create, replace — with the API server's semantics, over a small JSON file.

- `read_namespaced_lease`: the Lease, or ApiException 404 when the file does not exist.
- `create_namespaced_lease`: 409 when the file exists already (AlreadyExists).
- `replace_namespaced_lease`: 404 when absent, 409 when the body's resourceVersion is not the stored one (a
  candidate that read before another wrote), else the write, with a new resourceVersion.

Each call is one compare-and-swap under an exclusive `fcntl.flock` on `<file>.lock` (waited for at most the
call's connect timeout, a 504 past it: a stuck process cannot hang an election), and a write goes to a temporary
file renamed over the lease file, so a reader never sees half a record. A process that dies holding the lock
(SIGKILL) drops it with its file descriptors. Both files are created with mode 0600 in the directory the operator
gives, which must exist. A lease file that is not a regular file, is larger than `MAX_LEASE_FILE_BYTES`, or does
not hold a valid record is an error (ApiException 500 naming the file and what is wrong), never a crash: the
elector logs it and takes its failure path — a follower does not lead, a leader steps down after its renew
deadline — until an operator removes the file. A valid record's leaseDurationSeconds may be any integer (as an
API server's Lease may carry 2^31 - 1): whether its timing can be honoured is the elector's to judge, and one
it cannot (negative, over common/lease_election.py's MAX_LEASE_DURATION_S, a renewTime far ahead) it reports and takes
over. The objects are kubernetes' own V1Lease, so the elector runs unchanged.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import time
from datetime import datetime, timezone
from pathlib import Path

from kvgate.common import bounded_json

MAX_LEASE_FILE_BYTES = 4096  # a record is ~300 bytes
LOCK_TIMEOUT_S = 2.0  # without a `_request_timeout`: the elector's connect timeout
NOT_FOUND, CONFLICT, INVALID, SERVER_ERROR, TIMEOUT = 404, 409, 422, 500, 504
_FIELDS = ("name", "namespace", "holderIdentity", "leaseDurationSeconds", "acquireTime", "renewTime",
           "leaseTransitions", "resourceVersion")


def _error(status: int, reason: str):
    from kubernetes.client.rest import ApiException

    return ApiException(status=status, reason=reason)


def _time_out(value) -> str | None:
    if value is None:
        return None
    if not isinstance(value, datetime):
        raise _error(INVALID, f"a lease time must be a datetime, got {type(value).__name__}")
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return value.astimezone(timezone.utc).isoformat()


def _time_in(value) -> datetime | None:
    if value is None:
        return None
    parsed = datetime.fromisoformat(value)  # ValueError / TypeError: a corrupt record
    if parsed.tzinfo is None:
        raise ValueError(f"time without a zone: {value!r}")
    return parsed


def _check_int(value, what: str, allow_none: bool = True, signed: bool = False) -> None:
    if (value is None and not allow_none) or (value is not None and (type(value) is not int or
                                                                     (value < 0 and not signed))):
        raise ValueError(f"{what} must be a{'n' if signed else ' non-negative'} integer, got {value!r:.40}")


class FileLeaseApi:
    """The part of kubernetes' CoordinationV1Api that LeaseElector uses, over `path` (a JSON record)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")

    # --- the API ----------------------------------------------------------------------------------------------
    def read_namespaced_lease(self, name: str, namespace: str, _request_timeout=None):
        with self._locked(_request_timeout):
            record = self._load()
            if record is None or (record["name"], record["namespace"]) != (name, namespace):
                raise _error(NOT_FOUND, f"lease {namespace}/{name} not found in {self.path}")
            return self._lease(record)

    def create_namespaced_lease(self, namespace: str, body, _request_timeout=None):
        name = body.metadata.name if body.metadata else None
        if not name:
            raise _error(INVALID, "a lease needs metadata.name")
        record = self._record(body, name, namespace, resource_version=1)
        with self._locked(_request_timeout):
            if self._load() is not None:
                raise _error(CONFLICT, f"{self.path} holds a lease already (AlreadyExists)")
            self._store(record)
        return self._lease(record)

    def replace_namespaced_lease(self, name: str, namespace: str, body, _request_timeout=None):
        if body.metadata is None or body.metadata.name not in (None, name):
            raise _error(INVALID, f"the body names another lease than {name}")
        version = body.metadata.resource_version
        if not version:
            raise _error(INVALID, "metadata.resourceVersion must be specified for an update")
        with self._locked(_request_timeout):
            current = self._load()
            if current is None or (current["name"], current["namespace"]) != (name, namespace):
                raise _error(NOT_FOUND, f"lease {namespace}/{name} not found in {self.path}")
            if str(version) != current["resourceVersion"]:
                raise _error(CONFLICT, f"lease {namespace}/{name} changed: resourceVersion {version} is stale "
                                       f"(now {current['resourceVersion']})")
            record = self._record(body, name, namespace, resource_version=int(current["resourceVersion"]) + 1)
            self._store(record)
        return self._lease(record)

    # --- the record -------------------------------------------------------------------------------------------
    @staticmethod
    def _record(body, name: str, namespace: str, resource_version: int) -> dict:
        spec = body.spec
        if spec is None:
            raise _error(INVALID, "a lease needs a spec")
        for value, what in ((spec.lease_duration_seconds, "leaseDurationSeconds"),
                            (spec.lease_transitions, "leaseTransitions")):
            try:
                _check_int(value, what)
            except ValueError as exc:
                raise _error(INVALID, str(exc)) from None
        return {"name": name, "namespace": namespace, "holderIdentity": spec.holder_identity or "",
                "leaseDurationSeconds": spec.lease_duration_seconds, "acquireTime": _time_out(spec.acquire_time),
                "renewTime": _time_out(spec.renew_time), "leaseTransitions": spec.lease_transitions,
                "resourceVersion": str(resource_version)}

    @staticmethod
    def _lease(record: dict):
        from kubernetes.client import V1Lease, V1LeaseSpec, V1ObjectMeta

        return V1Lease(
            api_version="coordination.k8s.io/v1", kind="Lease",
            metadata=V1ObjectMeta(name=record["name"], namespace=record["namespace"],
                                  resource_version=record["resourceVersion"]),
            spec=V1LeaseSpec(holder_identity=record["holderIdentity"] or None,
                             lease_duration_seconds=record["leaseDurationSeconds"],
                             acquire_time=_time_in(record["acquireTime"]), renew_time=_time_in(record["renewTime"]),
                             lease_transitions=record["leaseTransitions"]))

    def _load(self) -> dict | None:
        """The stored record, None when there is no file; ApiException 500 for anything else than a valid one."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._corrupt(exc.strerror or str(exc)) from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise self._corrupt("not a regular file")
            if info.st_size > MAX_LEASE_FILE_BYTES:
                raise self._corrupt(f"{info.st_size} bytes, more than a lease's {MAX_LEASE_FILE_BYTES}")
            data = os.read(fd, MAX_LEASE_FILE_BYTES + 1)
        except OSError as exc:
            raise self._corrupt(exc.strerror or str(exc)) from None
        finally:
            os.close(fd)
        if len(data) > MAX_LEASE_FILE_BYTES:
            raise self._corrupt(f"more than a lease's {MAX_LEASE_FILE_BYTES} bytes")
        try:
            record = bounded_json.loads(data, MAX_LEASE_FILE_BYTES)  # nesting too: a ValueError, not a RecursionError
            if not isinstance(record, dict) or set(record) != set(_FIELDS):
                raise ValueError(f"expected an object with exactly {', '.join(_FIELDS)}")
            for key in ("name", "namespace", "holderIdentity"):
                if not isinstance(record[key], str):
                    raise ValueError(f"{key} must be a string")
            _check_int(record["leaseDurationSeconds"], "leaseDurationSeconds", signed=True)  # the elector judges it
            _check_int(record["leaseTransitions"], "leaseTransitions")
            if not (isinstance(record["resourceVersion"], str) and record["resourceVersion"].isdigit()):
                raise ValueError("resourceVersion must be a string of digits")
            _time_in(record["acquireTime"])
            _time_in(record["renewTime"])
        except (UnicodeDecodeError, ValueError, TypeError) as exc:  # JSONDecodeError is a ValueError
            raise self._corrupt(str(exc)) from None
        return record

    def _corrupt(self, why: str):
        return _error(SERVER_ERROR, f"lease file {self.path} is unusable ({why}); remove it to start a new "
                                    f"election")

    def _store(self, record: dict) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, json.dumps(record, separators=(",", ":")).encode())
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except OSError as exc:
            try:
                tmp.unlink()
            except OSError:
                pass
            raise _error(SERVER_ERROR, f"writing lease file {self.path}: {exc.strerror or exc}") from None

    # --- the lock ---------------------------------------------------------------------------------------------
    def _locked(self, request_timeout) -> "_FileLock":
        timeout = LOCK_TIMEOUT_S
        if isinstance(request_timeout, (int, float)):
            timeout = float(request_timeout)
        elif isinstance(request_timeout, tuple) and request_timeout:
            timeout = float(request_timeout[0])
        return _FileLock(self.lock_path, timeout)


class _FileLock:
    """An exclusive flock on a file of its own, opened per call (two electors in one process contend too)."""

    def __init__(self, path: Path, timeout: float) -> None:
        self.path, self.timeout = path, timeout
        self.fd: int | None = None

    def __enter__(self) -> "_FileLock":
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise _error(SERVER_ERROR, f"lease lock {self.path}: {exc.strerror or exc}") from None
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    os.close(fd)
                    raise _error(SERVER_ERROR, f"lease lock {self.path}: {exc.strerror or exc}") from None
            if time.monotonic() >= deadline:
                os.close(fd)
                raise _error(TIMEOUT, f"lease lock {self.path} held by another process for {self.timeout:g} s")
            time.sleep(0.005)
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the lock
            self.fd = None
