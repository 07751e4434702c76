"""The server's logging: one level and one format for agentbox's loggers and uvicorn's.

`agentbox serve --log-level LEVEL --log-format text|json` configures it once at start
(`config`, handed to uvicorn as its `log_config`). Text lines read `ts level logger [request_id] message`; JSON lines are one object
per line with `ts`, `level`, `logger`, `message`, `request_id` (when the line was written while
serving a request) and the access line's fields (`method`, `path`, `status`, `duration_ms`).
uvicorn's own access log is off: `agentbox.access` writes one line per request instead, with
the request id and secret query values redacted.
"""

from __future__ import annotations

import json
import logging
import logging.config
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

#: The formats `--log-format` accepts.
FORMATS = ("text", "json")
#: The levels `--log-level` accepts (uvicorn's names; `trace` is uvicorn's, below debug).
LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
#: Record attributes the JSON formatter copies when a line sets them (`extra=`).
EXTRA_FIELDS = ("method", "path", "status", "duration_ms")
#: The loggers configured: agentbox's own and uvicorn's server log.
LOGGERS = ("agentbox", "uvicorn", "uvicorn.error")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"


class RequestIdFilter(logging.Filter):
    """Stamps each record with the id of the request being served (`-` when none)."""

    def __init__(self, request_id: Callable[[], str | None]) -> None:
        super().__init__()
        self.request_id = request_id

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = self.request_id() or "-"
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line; never the record's arguments beyond the formatted message."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", "-")
        if request_id != "-":
            line["request_id"] = request_id
        for name in EXTRA_FIELDS:
            if hasattr(record, name):
                line[name] = getattr(record, name)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def config(level: str, fmt: str, request_id: Callable[[], str | None]) -> dict[str, Any]:
    """The `logging.config.dictConfig` (also uvicorn's `log_config`) for `level` and `fmt`."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    if level.lower() not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, not {level!r}")
    formatter: dict[str, Any] = (
        {"()": JsonFormatter} if fmt == "json" else {"format": TEXT_FORMAT, "datefmt": "%Y-%m-%dT%H:%M:%S%z"}
    )
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"request_id": {"()": RequestIdFilter, "request_id": request_id}},
        "formatters": {"agentbox": formatter},
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "stream": "ext://sys.stderr",
                "formatter": "agentbox",
                "filters": ["request_id"],
            }
        },
        "loggers": {
            **{
                name: {"handlers": ["stderr"], "level": level.upper(), "propagate": False} for name in LOGGERS
            },
            "uvicorn.access": {"handlers": [], "level": "CRITICAL", "propagate": False},
        },
    }
