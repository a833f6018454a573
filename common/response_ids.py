"""Responses API ids that say which replica stored them: `resp_` + an 8-hex tag of the answering engine's address
("ip:port", what `x-kvgate-endpoint` names) + 32 random hex digits. The engine makes them
(engine/server/serving_responses.py); the EPP's previous-response-affinity-filter reads the tag of a request's
`previous_response_id` and sends the request to the endpoint whose address has that tag — the only one holding
the stored response. The tag is a hash, so an id does not show the address; two endpoints of a pool sharing a
tag (one chance in 4 billion per pair) only lose the affinity."""

from __future__ import annotations

import hashlib
import re
import uuid

_ID = re.compile(r"resp_([0-9a-f]{8})[0-9a-f]{32}")


def endpoint_tag(address: str) -> str:
    return hashlib.sha256(address.encode()).hexdigest()[:8]


def new_response_id(address: str) -> str:
    return f"resp_{endpoint_tag(address)}{uuid.uuid4().hex}"


def tag_of(response_id) -> str | None:
    """The endpoint tag of a response id this scheme made; None for anything else."""
    if not isinstance(response_id, str):
        return None
    m = _ID.fullmatch(response_id)
    return m.group(1) if m else None
