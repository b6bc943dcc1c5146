"""`mmserve client`: one request the way the seeds' multimodal client (tools/multimodal/client.py) sends it,
printing the same `[beam i ]:` lines and `[INFO] Latency: N ms`.

gRPC (the default, like the seed) goes through tritonclient (ModelInfer, or ModelStreamInfer with --streaming)
with the seed's tensors per --model_type (PROTOCOL §5). `--protocol http` is mmserve's addition: the Triton
generate / generate_stream endpoint, with images as `image_url_input` data URIs (the generate JSON cannot
carry 5-D pixel tensors).
"""

from __future__ import annotations

import argparse
import sys
import time

from mmserve.entrypoints.client_request import ClientError, build_request, client_families
from mmserve.entrypoints.client_transport import send_grpc, send_http

DEFAULT_IMAGE = (
    "https://storage.googleapis.com/sfr-vision-language-research/LAVIS/assets/merlion.png"
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mmserve client", description=__doc__.split("\n\n")[0])
    p.add_argument("-v", "--verbose", action="store_true", help="verbose tritonclient")
    p.add_argument(
        "-u",
        "--url",
        default=None,
        help="server address (default localhost:8001 for grpc, localhost:8000 for http)",
    )
    p.add_argument(
        "--protocol",
        choices=("grpc", "http"),
        default="grpc",
        help="grpc (KServe v2, like the seed) or http (Triton generate endpoint)",
    )
    p.add_argument(
        "--model_name",
        default=None,
        help="target model (default: ensemble, or tensorrt_llm_bls with --use_bls)",
    )
    p.add_argument("--text", default="Question: which city is this? Answer:", help="input text")
    p.add_argument(
        "--image",
        default=DEFAULT_IMAGE,
        help="comma-separated image paths, http(s) URLs or data:image/...;base64 URIs ('' for none)",
    )
    p.add_argument("--video", default=None, help="video file (llava_onevision)")
    p.add_argument(
        "--video_num_frames", type=int, default=None, help="frames sampled from the video"
    )
    p.add_argument("--end-id", type=int, default=-1, help="end token id")
    p.add_argument("--pad-id", type=int, default=1, help="pad token id")
    p.add_argument(
        "-b",
        "--beam-width",
        type=int,
        default=1,
        help="beam width (also the number of beams printed)",
    )
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=None)
    p.add_argument("--request-output-len", type=int, default=16, help="max_tokens")
    p.add_argument("--top-k", type=int, default=1)
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument(
        "--streaming", action="store_true", help="stream (ModelStreamInfer / generate_stream)"
    )
    p.add_argument(
        "--use_bls", action="store_true", help="send to tensorrt_llm_bls instead of ensemble"
    )
    p.add_argument(
        "--prompt_table_extra_id",
        type=int,
        default=None,
        help="image identity for KV reuse, uint64 in [1, 2^64-1]",
    )
    p.add_argument(
        "--lora-task-id",
        type=int,
        default=None,
        help="lora_task_id UINT64: the LoRA adapter cached under this id (with --use_bls): loaded at "
        "startup (--lora-modules ID=PATH) or sent once with --lora-path",
    )
    p.add_argument(
        "--lora-path",
        default=None,
        help="directory with model.lora_weights.npy and model.lora_config.npy (TensorRT-LLM's "
        "hf_lora_convert.py output): sent as lora_weights / lora_config, cached under --lora-task-id",
    )
    p.add_argument(
        "--model_type",
        required=True,
        choices=sorted(client_families()),
        help="selects the image encoding",
    )
    p.add_argument(
        "--hf_model_dir",
        default=None,
        help="HF processor directory (blip2/llava/vila: "
        "preprocess to FP16 image_input; without it, raw image_bytes_input is sent)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the answer")
    return p


# ---- main ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Send one request, print its beams and latency; 1 on failure."""
    args = build_parser().parse_args(argv)
    url = args.url or ("localhost:8001" if args.protocol == "grpc" else "localhost:8000")
    try:
        req = build_request(args)
        start = time.perf_counter()
        if args.protocol == "grpc":
            responses = send_grpc(url, req, args.streaming, args.timeout, args.verbose)
        else:
            responses = send_http(url, req, args.streaming, args.timeout)
        latency_ms = round((time.perf_counter() - start) * 1000.0, 3)
    except ClientError as e:
        print(f"[ERROR] {e}", file=sys.stderr)
        return 1
    error = None
    for beams in responses:
        if isinstance(beams, ClientError):
            error = beams
            break
        if len(beams) < args.beam_width:
            print(
                f"[WARNING] asked for {args.beam_width} beams, the server returned {len(beams)}",
                file=sys.stderr,
            )
        for i, text in enumerate(beams[: args.beam_width]):
            if args.streaming:
                print("[beam", i, "]: ", text)
            else:
                print("[beam", i, "]:")
                print(text)
    if error is not None:
        print(f"[ERROR] {error}", file=sys.stderr)
        return 1
    print(f"[INFO] Latency: {latency_ms} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
