"""Logging for `loraplex serve`: plain text, or (--json-output) one JSON object per line on stderr."""

from __future__ import annotations

import json
import logging
import sys
from typing import TextIO

PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """timestamp, level, target (the logger's name) and message. A record with `fields` (the request log)
    carries them as keys in place of its message, which is the same fields written as key=value text."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"timestamp": self.formatTime(record), "level": record.levelname, "target": record.name}
        fields = getattr(record, "fields", None)
        if fields is None:
            line["message"] = record.getMessage()
        else:
            line.update(fields)
        if record.exc_info:  # the traceback inside the object: the line stays one line
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure_logging(json_output: bool = False, stream: TextIO | None = None) -> None:
    """Every log record (ours, uvicorn's, other libraries') at INFO and above to `stream` (stderr), as JSON
    objects or as plain lines. Replaces the root logger's handlers (without closing them)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if json_output else logging.Formatter(PLAIN_FORMAT))
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.captureWarnings(json_output)  # warnings.warn would print plain text to stderr


def configure_json_logging(stream: TextIO | None = None) -> None:
    configure_logging(True, stream)
