"""The server's one log format: `--log-format text` (time, level, logger, message) or `json` (one object per line:
`time`, `level`, `logger`, `message`, and a finished request's fields under their own keys), for every logger, the
HTTP server's included; and `--log-requests`' line per finished request."""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone
from typing import Any

from mmserve.core.outputs import RequestOutput

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
REQUESTS = logging.getLogger("mmserve.requests")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure_logging(level: str = "info", log_format: str = "text") -> None:
    """Root logging in `log_format` at `level`; loggers that bring their own handlers (uvicorn's) go through it."""
    if log_format not in ("text", "json"):
        raise ValueError(f"log format must be text or json, got {log_format!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(
        JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.propagate = True


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
