"""Leader election over a coordination.k8s.io/v1 Lease, shared by the EPP (active-passive replicas, epp/leader.py)
and the operator (its replicas, operator/leadership.py).

client-go's algorithm: a candidate takes the Lease when it does not exist, when it holds it already, or when its
holder has not renewed it for `lease_duration` as observed by this candidate (its own clock, from the moment it
last saw the record change — never the holder's timestamps, so clock skew does not matter); every write is a
replace at the read resourceVersion, so two candidates cannot both win. The leader renews every `retry_period`
and steps down when it could not renew for `renew_deadline`. A Lease another holder wrote with a timing no
election honours — a duration that is not a finite number in [0, MAX_LEASE_DURATION_S], or a renewTime more than
that ahead of this replica's clock — would otherwise hold the election for ever (999999999999 s): it is unusable,
logged as a warning (at once for each new holder or field at fault, then at most once a minute), and taken over as
if expired. On stop the leader releases the Lease (empty holder, 1 s duration), so a follower takes over at its
next try, one `retry_period` later, instead of waiting out the lease.

kubernetes' own leaderelection module is not used: it has no way to stop or release, its API calls have no
timeout (a silent connection would hang an election forever), and it sleeps in loops a stop cannot interrupt.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone

log = logging.getLogger(__name__)

# client-go's (and controller-runtime's, so upstream EPP's) defaults
DEFAULT_LEASE_DURATION_S = 15.0
DEFAULT_RENEW_DEADLINE_S = 10.0
DEFAULT_RETRY_PERIOD_S = 2.0
REQUEST_TIMEOUT = (2.0, 5.0)  # (connect, read) seconds per Lease call: below the renew deadline
CONFLICT, NOT_FOUND = 409, 404
# The longest lease an election honours (and --ha-lease-duration's most): a holder that stopped renewing keeps
# the replicas without a leader this long at worst. Also the most a renewTime may be ahead of this replica's clock.
MAX_LEASE_DURATION_S = 3600.0
UNUSABLE_REPORT_INTERVAL_S = 60.0  # an unusable Lease that stays so is logged again at most this often
_MAX_TRANSITIONS = 2**31 - 1  # leaseTransitions is an int32: a Lease at the top could never be replaced


def default_identity(fallback: str = "epp") -> str:
    """The pod's name (HOSTNAME in a pod, else `fallback`) and a random suffix: a restarted container is a new
    candidate."""
    return f"{os.environ.get('HOSTNAME') or fallback}_{secrets.token_hex(4)}"


def _now() -> datetime:
    return datetime.now(timezone.utc)


def unusable_lease(spec, now: datetime) -> str | None:
    """Why a Lease's timing cannot be honoured (None: it can): a leaseDurationSeconds that is not a finite number
    in [0, MAX_LEASE_DURATION_S], or a renewTime more than MAX_LEASE_DURATION_S after `now`."""
    duration = spec.lease_duration_seconds
    if duration is not None:
        if isinstance(duration, bool) or not isinstance(duration, (int, float)):
            return f"leaseDurationSeconds {duration!r:.40} is not a number"
        if isinstance(duration, float) and not math.isfinite(duration):
            return f"leaseDurationSeconds {duration} is not finite"
        if duration < 0:
            return f"leaseDurationSeconds {duration} is negative"
        if duration > MAX_LEASE_DURATION_S:
            return (f"leaseDurationSeconds {duration} is longer than the {MAX_LEASE_DURATION_S:.0f} s an election "
                    "honours")
    renew = spec.renew_time
    if isinstance(renew, datetime):
        if renew.tzinfo is None:
            renew = renew.replace(tzinfo=timezone.utc)
        if renew - now > timedelta(seconds=MAX_LEASE_DURATION_S):
            return (f"renewTime {renew.isoformat()} is more than {MAX_LEASE_DURATION_S:.0f} s ahead of this "
                    "replica's clock")
    return None


class LeaseElector:
    def __init__(self, api, name: str, namespace: str, identity: str, on_change: Callable[[bool], None], *,
                 lease_duration: float = DEFAULT_LEASE_DURATION_S, renew_deadline: float = DEFAULT_RENEW_DEADLINE_S,
                 retry_period: float = DEFAULT_RETRY_PERIOD_S, clock=time.monotonic,
                 can_lead: Callable[[], bool] = lambda: True) -> None:
        """`api`: a kubernetes CoordinationV1Api. `on_change(leading)` is called from the election thread.
        `can_lead()`: whether this candidate may take the Lease now — an EPP only once it can route, so that a
        replica still starting (a rollout's new pod) never wins over a warm follower and leaves the gateway
        without a ready EPP."""
        if not 0 < retry_period < renew_deadline < lease_duration <= MAX_LEASE_DURATION_S:
            raise ValueError(f"lease timings must satisfy 0 < retry period ({retry_period}) < renew deadline "
                             f"({renew_deadline}) < lease duration ({lease_duration}) <= {MAX_LEASE_DURATION_S:g}")
        self.api, self.name, self.namespace, self.identity = api, name, namespace, identity
        self.on_change = on_change
        self.lease_duration, self.renew_deadline, self.retry_period = lease_duration, renew_deadline, retry_period
        self._clock = clock
        self.can_lead = can_lead
        self.leading = False
        self.holder: str | None = None  # the holder last seen
        self._observed: tuple | None = None  # (holder, renewTime) last seen, and when it changed (our clock)
        self._observed_at = 0.0
        self._renewed_at = 0.0
        self._reported: tuple | None = None  # (holder, problem) of the unusable Lease last logged, and when
        self._reported_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- one attempt ----------------------------------------------------------------------------------------
    def try_acquire_or_renew(self) -> bool:
        from kubernetes.client import V1Lease, V1LeaseSpec, V1ObjectMeta
        from kubernetes.client.rest import ApiException

        now, mono = _now(), self._clock()
        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace, _request_timeout=REQUEST_TIMEOUT)
        except ApiException as e:
            if e.status != NOT_FOUND:
                log.warning("leader election: reading Lease %s/%s failed: %s %s", self.namespace, self.name,
                            e.status, e.reason)
                return False
            spec = V1LeaseSpec(holder_identity=self.identity, lease_duration_seconds=int(self.lease_duration),
                               acquire_time=now, renew_time=now, lease_transitions=0)
            try:
                self.api.create_namespaced_lease(self.namespace, V1Lease(
                    metadata=V1ObjectMeta(name=self.name, namespace=self.namespace), spec=spec),
                    _request_timeout=REQUEST_TIMEOUT)
            except ApiException as e2:
                log.info("leader election: creating Lease %s/%s failed: %s %s", self.namespace, self.name,
                         e2.status, e2.reason)
                return False
            self._observe(self.identity, now, mono)
            return True
        spec = lease.spec or V1LeaseSpec()
        holder = spec.holder_identity or ""
        self._observe(holder, spec.renew_time, mono)
        if holder and holder != self.identity:
            problem = unusable_lease(spec, now)
            if problem is not None:
                self._report_unusable(holder, problem, mono)  # and taken over below, as if expired
            elif mono < self._observed_at + float(spec.lease_duration_seconds or self.lease_duration):
                return False  # held by another candidate that renewed within its lease, as far as we have seen
        transitions = spec.lease_transitions
        if not isinstance(transitions, int) or isinstance(transitions, bool) \
                or not 0 <= transitions < _MAX_TRANSITIONS:
            transitions = 0  # absent, or a count no replace could advance: counting starts again
        spec.acquire_time = spec.acquire_time if holder == self.identity else now
        spec.lease_transitions = transitions if holder == self.identity else transitions + 1
        spec.holder_identity, spec.renew_time = self.identity, now
        spec.lease_duration_seconds = int(self.lease_duration)
        lease.spec = spec
        try:
            self.api.replace_namespaced_lease(self.name, self.namespace, lease, _request_timeout=REQUEST_TIMEOUT)
        except ApiException as e:
            if e.status != CONFLICT:
                log.warning("leader election: updating Lease %s/%s failed: %s %s", self.namespace, self.name,
                            e.status, e.reason)
            return False  # a conflict: another candidate wrote first
        self._observe(self.identity, now, mono)
        return True

    def _report_unusable(self, holder: str, problem: str, mono: float) -> None:
        key = (holder, problem.split(" ")[0])  # the field at fault: a holder renewing absurdly is one report a minute
        if key == self._reported and mono - self._reported_at < UNUSABLE_REPORT_INTERVAL_S:
            return
        self._reported, self._reported_at = key, mono
        log.warning("leader election: Lease %s/%s held by %.100r is unusable (%s): taking it over as if expired",
                    self.namespace, self.name, holder, problem)

    def _observe(self, holder: str, renew_time, mono: float) -> None:
        record = (holder, renew_time)
        if record != self._observed:
            self._observed, self._observed_at = record, mono
        if holder != self.holder:
            if self.holder is not None:
                log.info("leader election: the Lease is now held by %s", holder or "(nobody)")
            self.holder = holder

    def release(self) -> None:
        """Give the Lease up (only if we hold it): followers take it at their next try."""
        from kubernetes.client.rest import ApiException

        if not self.leading:
            return
        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace, _request_timeout=REQUEST_TIMEOUT)
            if (lease.spec.holder_identity or "") != self.identity:
                return
            lease.spec.holder_identity = ""
            lease.spec.lease_duration_seconds = 1
            lease.spec.renew_time = _now()
            self.api.replace_namespaced_lease(self.name, self.namespace, lease, _request_timeout=REQUEST_TIMEOUT)
            log.info("leader election: released Lease %s/%s", self.namespace, self.name)
        except ApiException as e:
            log.warning("leader election: releasing Lease %s/%s failed: %s %s", self.namespace, self.name, e.status,
                        e.reason)
        finally:
            self._set_leading(False)

    def wait_for_successor(self, timeout_s: float, poll_s: float = 0.1) -> str | None:
        """After `release`: the next holder once one has taken the Lease, or None after `timeout_s`."""
        from kubernetes.client.rest import ApiException

        deadline = self._clock() + timeout_s
        while self._clock() < deadline:
            try:
                lease = self.api.read_namespaced_lease(self.name, self.namespace, _request_timeout=REQUEST_TIMEOUT)
                holder = (lease.spec.holder_identity if lease.spec else "") or ""
                if holder and holder != self.identity:
                    return holder
            except ApiException as e:
                log.warning("leader election: reading Lease %s/%s failed: %s %s", self.namespace, self.name,
                            e.status, e.reason)
            time.sleep(poll_s)
        return None

    def holds_lease(self) -> bool:
        """Whether this candidate leads and renewed within `renew_deadline` by its own clock: a fence for writes,
        stricter than `leading`, which drops only at the next round after the deadline. No other candidate can
        take the Lease before `lease_duration` (> renew deadline) has passed since it saw our last renewal."""
        return self.leading and self._clock() - self._renewed_at < self.renew_deadline

    # --- the loop ---------------------------------------------------------------------------------------------
    def _set_leading(self, leading: bool) -> None:
        if leading != self.leading:
            self.leading = leading
            log.info("leader election: %s Lease %s/%s (%s)", "leading: this replica holds" if leading
                     else "following: another replica leads or may lead; not holding", self.namespace, self.name,
                     self.identity)
            self.on_change(leading)

    def step(self) -> None:
        """One round: try, and lead or follow by the result and the renew deadline."""
        if not self.leading and not self.can_lead():
            return
        if self.try_acquire_or_renew():
            self._renewed_at = self._clock()
            self._set_leading(True)
        elif self.leading and self.holder not in (None, self.identity):
            log.warning("leader election: %s holds the Lease now: stepping down", self.holder)
            self._set_leading(False)
        elif self.leading and self._clock() - self._renewed_at >= self.renew_deadline:
            log.warning("leader election: could not renew the Lease for %.0f s: stepping down", self.renew_deadline)
            self._set_leading(False)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="leader-election", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception:  # a bug or an unexpected client error: never end the election silently
                log.exception("leader election: round failed")
                if self.leading and self._clock() - self._renewed_at >= self.renew_deadline:
                    self._set_leading(False)
            self._stop.wait(self.retry_period)

    def stop(self, release: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=REQUEST_TIMEOUT[0] + REQUEST_TIMEOUT[1] + 1)
        if release:
            self.release()
