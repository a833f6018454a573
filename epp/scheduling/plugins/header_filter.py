"""header-based-testing-filter: the conformance suite's way to steer a request to chosen endpoints.

Header `test-epp-endpoint-selection: item[,item...]`, each item "ip:port" (exactly that endpoint) or "ip" (every
endpoint on that IP, e.g. all data-parallel ranks of one pod, in a per-request random order so load spreads over
the ranks). The result keeps the listed order — primary first, then fallbacks — and skips scoring (a
PinnedOrder). Nothing listed matches → [] and the caller answers 503.
No header (or a blank one) → every candidate passes, unchanged: the filter can sit first in production configs.
"""

from __future__ import annotations

import random

from kvgate.common.epp_protocol import TEST_ENDPOINT_SELECTION_HEADER
from kvgate.epp.scheduling.framework import CycleState, Filter, PinnedOrder
from kvgate.epp.scheduling.plugins._params import check_keys
from kvgate.epp.types import EndpointState, LLMRequest

HEADER = TEST_ENDPOINT_SELECTION_HEADER


def split_host_port(item: str) -> tuple[str, str]:
    """"1.2.3.4:80" → ("1.2.3.4", "80"); "[::1]:80" → ("::1", "80"); "1.2.3.4" or "::1" → (ip, "")."""
    if item.startswith("["):
        host, _, rest = item[1:].partition("]")
        return host, rest[1:] if rest.startswith(":") else ""
    if item.count(":") == 1:
        host, _, port = item.partition(":")
        return host, port
    return item, ""  # a bare IPv4, or a bare IPv6 address with several colons


def header_value(headers, key: str) -> str | None:
    value = headers.get(key)
    if value is None:  # Envoy sends lower-case names; tolerate other callers
        for k, v in headers.items():
            if k.lower() == key:
                return v
    return value


class HeaderBasedTestingFilter(Filter):
    type_name = "header-based-testing-filter"

    def filter(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState | None = None
               ) -> list[EndpointState]:
        value = header_value(request.headers, HEADER)
        if value is None or not value.strip():
            return endpoints
        by_ip: dict[str, list[EndpointState]] = {}
        by_address: dict[tuple[str, str], EndpointState] = {}
        for e in endpoints:
            host, port = split_host_port(e.address)
            by_ip.setdefault(host, []).append(e)
            by_address[(host, port)] = e
        selected = PinnedOrder()
        seen: set[str] = set()
        for raw in value.split(","):
            item = raw.strip()
            if not item:
                continue
            host, port = split_host_port(item)
            if port:
                matches = [by_address[(host, port)]] if (host, port) in by_address else []
            else:
                matches = list(by_ip.get(host, ()))
                if len(matches) > 1:
                    random.Random(request.request_id).shuffle(matches)
            for e in matches:
                if e.address not in seen:
                    seen.add(e.address)
                    selected.append(e)
        return selected


def factory(parameters: dict | None) -> HeaderBasedTestingFilter:
    check_keys(parameters, set(), HeaderBasedTestingFilter.type_name)
    return HeaderBasedTestingFilter()
