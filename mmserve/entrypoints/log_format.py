"""`--log-requests`' line per finished request, in the server's log format (core/logs.py: its fields under their
own keys in json)."""

from __future__ import annotations

import logging

from mmserve.core.outputs import RequestOutput

REQUESTS = logging.getLogger("mmserve.requests")


def log_finished(out: RequestOutput) -> None:
    """`--log-requests`: one line per finished request (id, prompt / image / output tokens, TTFT, e2e, finish)."""
    m = out.metrics
    completion = out.outputs[0] if out.outputs else None
    fields = {
        "request_id": out.request_id,
        "prompt_tokens": len(out.prompt_token_ids or []),
        "image_tokens": m.num_media_tokens if m is not None else 0,
        "output_tokens": len(completion.token_ids) if completion else 0,
        "ttft_s": None,
        "e2e_s": None,
        "finish_reason": completion.finish_reason if completion else None,
    }
    if m is not None and m.first_token_time is not None:
        fields["ttft_s"] = round(m.first_token_time - m.arrival_time, 4)
    if m is not None and m.finished_time is not None:
        fields["e2e_s"] = round(m.finished_time - m.arrival_time, 4)
    text = " ".join(f"{k}={v}" for k, v in fields.items())
    REQUESTS.info("finished: %s", text, extra={"fields": fields})
