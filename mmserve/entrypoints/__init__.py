"""Serving frontends: HTTP, gRPC, CLI and client."""
