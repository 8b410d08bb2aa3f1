"""The wire: generated stubs (v1/), message <-> dataclass conversion (convert.py), the shared
server plumbing (serving.py) and clients with deadlines and retries (clients.py). The only
part of specdec that imports grpc or protobuf."""
