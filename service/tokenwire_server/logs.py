"""Structured logging: one JSON object a line (or plain text), with the request id."""

from __future__ import annotations

import json
import logging
import sys
import time

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


def escape_controls(text: str) -> str:
    """``text`` with every unprintable character (CR, LF, ESC, other controls, line and
    paragraph separators) written as its escape, so that no value can start a forged log
    line or move a terminal's cursor."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


class TextFormatter(logging.Formatter):
    """``HH:MM:SS LEVEL message  key=value ...``: one line a record (a traceback follows on its own
    lines); the message and the values are escaped, since callers' values reach them."""

    def format(self, record: logging.LogRecord) -> str:
        extras = " ".join(
            f"{k}={escape_controls(str(v))}"
            for k, v in record.__dict__.items()
            if k not in _STANDARD and not k.startswith("_")
        )
        line = f"{self.formatTime(record, '%H:%M:%S')} {record.levelname:<7} {escape_controls(record.getMessage())}"
        if extras:
            line += f"  {extras}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def configure_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("transformers", "accelerate", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLevelName(level)))
