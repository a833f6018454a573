"""Do-nothing ext-proc server on grpcio's synchronous API: each stream holds a thread of the pool while it lasts
(a request's whole life, its response included), iterating the requests and yielding the responses."""

from __future__ import annotations

from concurrent import futures

import grpc

from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from kvgate.bench.extproc_noop.replies import NoopStream, parse_args, routing

THREADS = 128  # streams served at once (more wait for a thread); the bench's load keeps far fewer in flight


class Servicer(pb_grpc.ExternalProcessorServicer):
    def __init__(self, destination: str) -> None:
        self.routing = routing(destination)

    def Process(self, request_iterator, context):  # noqa: N802 - gRPC method name
        stream = NoopStream(self.routing)
        for msg in request_iterator:
            yield from stream.handle(msg)


def serve(port: int, destination: str) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=THREADS))
    pb_grpc.add_ExternalProcessorServicer_to_server(Servicer(destination), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


if __name__ == "__main__":
    args = parse_args(__doc__)
    serve(args.port, args.destination)
