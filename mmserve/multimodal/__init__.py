"""Media inputs: loading, hashing, video decoding and per-family prompt processing."""
