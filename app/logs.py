"""Logging set-up: plain lines, or one JSON object per line (``--log-json``) with the request
ID and any extra fields."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


# Control characters a message may carry from a client (a request path, a file name), escaped
# in plain lines; tabs stay, and line breaks are kept but indented (below).
_ESCAPES = {c: f"\\x{c:02x}" for c in [*range(32), 127] if c not in (9, 10)} | {13: "\\r"}


class LineFormatter(logging.Formatter):
    """``time level logger: message``. A message's further lines (a traceback uvicorn logs as
    its message, or a line break a client put in a path) are indented: only a record starts a
    line at column 0, so nothing in a message can pass for a record of its own. Other control
    characters are escaped."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        record.message = record.message.translate(_ESCAPES).replace("\n", "\n    ")
        return super().formatMessage(record)


def setup(level: str = "INFO", json_lines: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json_lines else LineFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
