"""Live load: this EPP's exact in-flight requests and tokens, as numpy columns over a scrape round's snapshot.

The herd problem. The director reuses one list of EndpointStates per scrape round (50 ms by default) so that
the scheduler's per-snapshot caches hold; but a state's numbers are frozen at the round's start. A burst of
requests within one round then sees the same "best" endpoint again and again: 421 of 1000 burst requests went
to one of 4 equal replicas. The engine's own queue metrics cannot help either: they show a request only once it
has arrived and the next scrape has read it.

The fix keeps the snapshot (its metric columns stay cached) and lays a live overlay on it. The LoadTracker
records every pick (a Flight) and every release; for the current snapshot it keeps a LiveLoad: arrays aligned
with the snapshot's endpoints, updated in O(1) on each pick and release:

    requests[i], tokens[i]                  in flight from this EPP to endpoint i (tokens: prompt + max_tokens)
    unseen_requests[i], unseen_prompt[i]    those picked after the scrape the snapshot holds for endpoint i
                                            (picked_at > metrics.updated_at): not yet in its scraped numbers

so a plugin reads, per decision, e.g. effective waiting = scraped waiting + unseen_requests (queue-scorer) or
in-flight tokens (token-load-scorer), exact to the last pick and release. A request routed just before a scrape
but not yet arrived at the engine is counted by neither (an undercount of at most the gateway's transit time).
Building a LiveLoad costs O(endpoints + requests picked since the scrape) once per snapshot; `kvgate bench epp` prints the
decision time with the overlay on (live-load column).

Plugins find the LiveLoad in `cycle.load` (framework.CycleState); without one (a caller that builds states per
request) `live_column()` falls back to the states' own in_flight_* fields and counts nothing as unseen.
"""

from __future__ import annotations

import operator
import time
from bisect import bisect_right
from collections.abc import Mapping

import numpy as np

from kvgate.epp.types import EndpointState, LLMRequest

COLUMNS = ("requests", "tokens", "unseen_requests", "unseen_prompt")
_picked_at = operator.attrgetter("picked_at")


class Flight:
    """One routed request, from pick to release."""

    __slots__ = ("request", "address", "picked_at", "tokens", "prompt_tokens")

    def __init__(self, request: LLMRequest, address: str, picked_at: float, tokens: int, prompt_tokens: int):
        self.request = request
        self.address = address
        self.picked_at = picked_at  # time.monotonic(), comparable with EndpointMetrics.updated_at
        self.tokens = tokens
        self.prompt_tokens = prompt_tokens


class AddressLoad:
    """An endpoint's flights in pick order, and their totals."""

    __slots__ = ("requests", "tokens", "flights")

    def __init__(self) -> None:
        self.requests = 0
        self.tokens = 0
        self.flights: list[Flight] = []


class LiveLoad:
    """The overlay for one snapshot (a list of EndpointStates): see the module docstring."""

    __slots__ = ("states", "positions", "scraped_at", "requests", "tokens", "unseen_requests", "unseen_prompt",
                 "unseen_total", "_last_list", "_last_index")

    def __init__(self, states: list[EndpointState], by_address: Mapping[str, AddressLoad]) -> None:
        n = len(states)
        self.states = states
        self.positions = positions = {s.address: i for i, s in enumerate(states)}
        scraped_at = [s.metrics.updated_at for s in states]
        self.scraped_at = np.array(scraped_at, dtype=float)
        # Built as lists, then arrays (cheaper than per-element numpy updates), with one spare slot, always 0:
        # where column() maps endpoints the snapshot does not know.
        requests, tokens, unseen_requests, unseen_prompt = ([0.0] * (n + 1) for _ in range(4))
        self.unseen_total = 0
        for address, load in by_address.items():
            i = positions.get(address)
            if i is None:
                continue
            requests[i], tokens[i] = load.requests, load.tokens
            # flights are in pick order: those after the scrape are a tail, found by bisection (a round's
            # rebuild costs O(endpoints + picks of the last round), not O(everything in flight))
            unseen = load.flights[bisect_right(load.flights, scraped_at[i], key=_picked_at):]
            if unseen:
                unseen_requests[i] = len(unseen)
                unseen_prompt[i] = sum(f.prompt_tokens for f in unseen)
                self.unseen_total += len(unseen)
        self.requests, self.tokens = np.array(requests), np.array(tokens)
        self.unseen_requests, self.unseen_prompt = np.array(unseen_requests), np.array(unseen_prompt)
        self._last_list: list[EndpointState] | None = None  # column() of a filtered list: its index, once
        self._last_index: np.ndarray | None = None

    def add(self, i: int, flight: Flight, sign: int) -> None:
        self.requests[i] += sign
        self.tokens[i] += sign * flight.tokens
        if flight.picked_at > self.scraped_at[i]:
            self.unseen_requests[i] += sign
            self.unseen_prompt[i] += sign * flight.prompt_tokens
            self.unseen_total += sign

    def column(self, name: str, endpoints: list[EndpointState]) -> np.ndarray:
        """Column `name` (one of COLUMNS) aligned with `endpoints`: the snapshot's list itself or a sublist of it
        (endpoints it does not know count 0). Read-only: callers compute new arrays from it."""
        values: np.ndarray = getattr(self, name)
        n = len(self.states)
        if endpoints is self.states:
            return values[:n]
        if endpoints is not self._last_list:  # the scheduler's copy of the snapshot, a filtered list: once each
            if len(endpoints) == n and all(map(operator.is_, endpoints, self.states)):
                index = None
            else:
                get = self.positions.get
                index = np.fromiter((get(e.address, n) for e in endpoints), dtype=np.intp, count=len(endpoints))
            self._last_list, self._last_index = endpoints, index
        return values[:n] if self._last_index is None else values[self._last_index]


class LoadTracker:
    """Every request this EPP routed and has not released, by endpoint; the LiveLoad of the current snapshot."""

    def __init__(self) -> None:
        self.by_address: dict[str, AddressLoad] = {}
        self._view: LiveLoad | None = None

    def view(self, states: list[EndpointState]) -> LiveLoad:
        """The LiveLoad of `states` (built once per list: the director passes the round's snapshot)."""
        view = self._view
        if view is None or view.states is not states:
            view = self._view = LiveLoad(states, self.by_address)
        return view

    def add(self, request: LLMRequest, address: str, tokens: int, prompt_tokens: int) -> Flight:
        flight = Flight(request, address, time.monotonic(), tokens, prompt_tokens)
        load = self.by_address.get(address)
        if load is None:
            load = self.by_address[address] = AddressLoad()
        load.requests += 1
        load.tokens += tokens
        load.flights.append(flight)
        self._overlay(flight, +1)
        return flight

    def release(self, request: LLMRequest, address: str) -> Flight | None:
        """Forget `request`'s flight to `address` (None when there is none: released twice, or never picked)."""
        load = self.by_address.get(address)
        if load is None:
            return None
        flights = load.flights
        for k in range(len(flights) - 1, -1, -1):  # usually among the older ones, but lists are short
            if flights[k].request is request:
                flight = flights.pop(k)
                break
        else:
            return None
        load.requests -= 1
        load.tokens -= flight.tokens
        if not flights:
            del self.by_address[address]
        self._overlay(flight, -1)
        return flight

    def counts(self) -> dict[str, tuple[int, int]]:
        """address → (requests, tokens) in flight."""
        return {a: (load.requests, load.tokens) for a, load in self.by_address.items()}

    def _overlay(self, flight: Flight, sign: int) -> None:
        view = self._view
        if view is not None:
            i = view.positions.get(flight.address)
            if i is not None:
                view.add(i, flight, sign)


def live_column(cycle, endpoints: list[EndpointState], name: str) -> np.ndarray:
    """Live column `name` for `endpoints` from the cycle's LiveLoad; without one, the states' own in-flight
    fields (requests, tokens) and 0 for the unseen columns."""
    view: LiveLoad | None = getattr(cycle, "load", None) if cycle is not None else None
    if view is not None:
        return view.column(name, endpoints)
    if name == "requests":
        return np.fromiter((e.in_flight_requests for e in endpoints), dtype=float, count=len(endpoints))
    if name == "tokens":
        return np.fromiter((e.in_flight_tokens for e in endpoints), dtype=float, count=len(endpoints))
    return np.zeros(len(endpoints))


def unseen_total(cycle) -> int:
    """How many in-flight requests the cycle's snapshot does not show yet (0 without a LiveLoad)."""
    view = getattr(cycle, "load", None) if cycle is not None else None
    return view.unseen_total if view is not None else 0
