"""Triton Inference Server's frontends for TensorRT-LLM's models: KServe v2 over HTTP (`http.py`) and gRPC
(`grpc_server.py`) and the generate extension, over the shared helpers of `mmserve.entrypoints`."""
