"""Do-nothing ext-proc server on grpcio's asyncio API (grpc.aio), read/write as kvgate's EPP reads and writes."""

from __future__ import annotations

import asyncio

import grpc

from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from kvgate.bench.extproc_noop.replies import NoopStream, parse_args, routing


class Servicer(pb_grpc.ExternalProcessorServicer):
    def __init__(self, destination: str) -> None:
        self.routing = routing(destination)

    async def Process(self, request_iterator, context):  # noqa: N802 - gRPC method name
        stream = NoopStream(self.routing)
        while True:
            msg = await context.read()
            if msg is grpc.aio.EOF:
                return
            for response in stream.handle(msg):
                await context.write(response)


async def serve(port: int, destination: str) -> None:
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(Servicer(destination), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


if __name__ == "__main__":
    args = parse_args(__doc__)
    asyncio.run(serve(args.port, args.destination))
