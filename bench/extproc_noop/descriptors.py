"""The ext-proc service's protobuf descriptors, from the installed Python protos (xds-protos), as one serialized
FileDescriptorSet: what a server in another language loads its message types from, so that no .proto files need
shipping."""

from __future__ import annotations

from pathlib import Path

from google.protobuf import descriptor_pb2


def ext_proc_descriptor_set() -> bytes:
    """external_processor.proto and every file it imports, dependencies first."""
    from envoy.service.ext_proc.v3 import external_processor_pb2

    files: list = []
    seen: set[str] = set()

    def add(fd) -> None:
        if fd.name in seen:
            return
        seen.add(fd.name)
        for dep in fd.dependencies:
            add(dep)
        proto = descriptor_pb2.FileDescriptorProto()
        fd.CopyToProto(proto)
        files.append(proto)

    add(external_processor_pb2.DESCRIPTOR)
    return descriptor_pb2.FileDescriptorSet(file=files).SerializeToString()


def write_ext_proc_descriptor_set(path: Path) -> Path:
    path.write_bytes(ext_proc_descriptor_set())
    return path
