"""The do-nothing answer to one ext-proc stream, shared by the Python servers: the message sequence of kvgate's EPP
(epp/extproc.py `_RequestStream.handle`), every request sent to one destination, nothing parsed.

FULL_DUPLEX_STREAMED request body: the headers are answered only after the body's end (Envoy holds the request until
then), with the destination header, clear_route_cache and the `envoy.lb` metadata, followed by the body streamed back
whole; BUFFERED: headers at once, the decision on the body. Response body chunks are echoed in FULL_DUPLEX_STREAMED
mode and acknowledged otherwise; trailers and response headers are acknowledged.
"""

from __future__ import annotations

import argparse

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from kvgate.common.epp_protocol import DESTINATION_HEADER, DESTINATION_NAMESPACE

FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


def routing(destination: str) -> tuple[pb.CommonResponse, struct_pb2.Struct]:
    """The constant routing answer: the header mutation with clear_route_cache, and the dynamic metadata."""
    common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=DESTINATION_HEADER, raw_value=destination.encode()))]),
        clear_route_cache=True)
    metadata = struct_pb2.Struct()
    metadata.update({DESTINATION_NAMESPACE: {DESTINATION_HEADER: destination}})
    return common, metadata


class NoopStream:
    """One HTTP request's ext-proc stream: `handle` each message, send what it returns, in order."""

    def __init__(self, destination: tuple[pb.CommonResponse, struct_pb2.Struct]) -> None:
        self.common, self.metadata = destination
        self.request_full_duplex = False
        self.response_full_duplex = False
        self.decided = False
        self.body = bytearray()

    def handle(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if msg.HasField("protocol_config"):
            self.request_full_duplex = msg.protocol_config.request_body_mode == FULL_DUPLEX
            self.response_full_duplex = msg.protocol_config.response_body_mode == FULL_DUPLEX
        kind = msg.WhichOneof("request")
        if kind == "request_headers":
            if msg.request_headers.end_of_stream:
                self.decided = True
                return [pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=self.common),
                                              dynamic_metadata=self.metadata)]
            if self.request_full_duplex:
                return []
            return [pb.ProcessingResponse(request_headers=pb.HeadersResponse())]
        if kind == "request_body":
            if self.decided:
                return []
            self.body += msg.request_body.body
            if msg.request_body.end_of_stream or not self.request_full_duplex:
                return self._decide(msg.request_body.end_of_stream)
            return []
        if kind == "request_trailers":
            decided = [] if self.decided else self._decide(False)
            return [*decided, pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        if kind == "response_headers":
            return [pb.ProcessingResponse(response_headers=pb.HeadersResponse())]
        if kind == "response_body":
            if self.response_full_duplex:
                return [pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
                    body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                        body=msg.response_body.body, end_of_stream=msg.response_body.end_of_stream)))))]
            return [pb.ProcessingResponse(response_body=pb.BodyResponse())]
        if kind == "response_trailers":
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []

    def _decide(self, end_of_stream: bool) -> list[pb.ProcessingResponse]:
        self.decided = True
        body, self.body = bytes(self.body), bytearray()
        if self.request_full_duplex:
            return [pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=self.common),
                                          dynamic_metadata=self.metadata),
                    pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
                        body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                            body=body, end_of_stream=end_of_stream)))))]
        return [pb.ProcessingResponse(request_body=pb.BodyResponse(response=self.common),
                                      dynamic_metadata=self.metadata)]


def parse_args(description: str) -> argparse.Namespace:
    """The servers' common flags."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--port", type=int, required=True, help="the ext-proc gRPC port, on 127.0.0.1")
    p.add_argument("--destination", required=True, help="ip:port every request is sent to")
    return p.parse_args()
