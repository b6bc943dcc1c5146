"""The server's one log format, for each of its processes (the server and its tensor-parallel ranks):
`--log-format text` (time, level, logger, message) or `json` (one object per line: `time`, `level`, `logger`,
`message`, a record's `fields` under their own keys); a worker's lines also say which rank wrote them."""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone
from typing import Any

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    def __init__(self, origin: str | None = None) -> None:
        super().__init__()
        self.origin = origin

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if self.origin:
            out["origin"] = self.origin
        out.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure_logging(
    level: str = "info", log_format: str = "text", origin: str | None = None
) -> None:
    """Root logging in `log_format` at `level`; loggers that bring their own handlers (uvicorn's) go through it.
    `origin`: what the lines say wrote them (a worker's "tp1 node0")."""
    if log_format not in ("text", "json"):
        raise ValueError(f"log format must be text or json, got {log_format!r}")
    text = (
        TEXT_FORMAT
        if not origin
        else TEXT_FORMAT.replace(" %(levelname)s", f" {origin} %(levelname)s")
    )
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(origin) if log_format == "json" else logging.Formatter(text))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.propagate = True


def current_logging() -> tuple[str, str]:
    """(level, format) this process logs at, for the worker processes it spawns."""
    root = logging.getLogger()
    json_lines = any(isinstance(h.formatter, JsonFormatter) for h in root.handlers)
    return logging.getLevelName(root.level).lower(), "json" if json_lines else "text"
