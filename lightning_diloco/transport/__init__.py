"""gRPC transport: the .proto, its generated modules, chunked streaming and the client."""
