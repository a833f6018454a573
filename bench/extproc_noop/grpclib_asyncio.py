"""Do-nothing ext-proc server on grpclib (pure-Python gRPC over h2, asyncio): the ExternalProcessor/Process method
registered by hand (`__mapping__`) with the protobuf message classes of the installed envoy protos, no generated
stubs."""

from __future__ import annotations

import asyncio

from grpclib.const import Cardinality, Handler
from grpclib.server import Server

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from kvgate.bench.extproc_noop.replies import NoopStream, parse_args, routing

METHOD = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


class ExternalProcessor:
    def __init__(self, destination: str) -> None:
        self.routing = routing(destination)

    async def process(self, stream) -> None:
        noop = NoopStream(self.routing)
        async for msg in stream:
            for response in noop.handle(msg):
                await stream.send_message(response)

    def __mapping__(self) -> dict:  # noqa: N807 - grpclib's protocol
        return {METHOD: Handler(self.process, Cardinality.STREAM_STREAM, pb.ProcessingRequest, pb.ProcessingResponse)}


async def serve(port: int, destination: str) -> None:
    server = Server([ExternalProcessor(destination)])
    await server.start("127.0.0.1", port)
    await server.wait_closed()


if __name__ == "__main__":
    args = parse_args(__doc__)
    asyncio.run(serve(args.port, args.destination))
