"""previous-response-affinity-filter: a Responses API request that continues a stored response
(`previous_response_id`) goes to the endpoint that stored it — only that engine holds the conversation, and any
other answers 404. The id carries a tag of that endpoint's address (common/response_ids.py); the filter keeps the
candidates with that tag. A preference filter: when the endpoint is gone (or the id is not one of these), every
candidate is kept, and with fallbacks the others follow it. Requests without `previous_response_id` pass
unchanged, so it can sit first in any profile (kvgate's has it)."""

from __future__ import annotations

from collections.abc import Mapping

from kvgate.common.response_ids import endpoint_tag, tag_of
from kvgate.epp.scheduling.framework import CycleState, Filter
from kvgate.epp.scheduling.plugins._params import check_keys
from kvgate.epp.types import EndpointState, LLMRequest


class PreviousResponseAffinityFilter(Filter):
    type_name = "previous-response-affinity-filter"
    preference = True

    def filter(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState | None = None
               ) -> list[EndpointState]:
        body = request.body
        tag = tag_of(body.get("previous_response_id")) if isinstance(body, Mapping) else None
        if tag is None:
            return endpoints
        kept = [e for e in endpoints if endpoint_tag(e.address) == tag]
        return kept or endpoints


def factory(parameters: dict | None) -> PreviousResponseAffinityFilter:
    check_keys(parameters, set(), PreviousResponseAffinityFilter.type_name)
    return PreviousResponseAffinityFilter()
