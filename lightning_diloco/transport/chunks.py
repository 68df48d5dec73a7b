"""Chunk sizes of streamed payloads: no message ever nears gRPC's size limits (the chunked
messages themselves are written and read in wire.py)."""

# 3 MiB: a 1M-parameter bf16 payload is one message instead of two (each message is a hand-off
# between gRPC's threads on the receiving side), and a chunk with its header still fits the
# 4 MiB receive limit of releases that sent 1 MiB chunks.
CHUNK_BYTES = 3 << 20
MAX_MESSAGE_BYTES = 4 * CHUNK_BYTES  # receive limit on both ends: a chunk plus its header
