"""`python -m mmserve.entrypoints.demo`: one offline request on the embedded demo model, with its latency."""

from __future__ import annotations

import time

from mmserve import LLM, SamplingParams
from mmserve.testing import default_model_dir, make_test_image


def main() -> None:
    llm = LLM(str(default_model_dir()))
    prompt = {
        "prompt": "USER: <image>\nWhat is in this picture? ASSISTANT:",
        "images": [make_test_image(0)],
    }
    start = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0))[0]
    ms = (time.perf_counter() - start) * 1000
    print(f"[beam 0 ]:\n{out.outputs[0].text}\n[INFO] Latency: {ms:.3f} ms")


if __name__ == "__main__":
    main()
