"""Logging for every process: plain text or one JSON object per line, with the request id.

Handlers set ``request_id_var`` while they work on a request (the id travels from the
gateway to the workers in every internal call), so a log line from any process can be joined
with the others on ``request_id``.
"""
from __future__ import annotations

import contextvars
import faulthandler
import json
import logging
import signal
import sys
import time

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = getattr(record, "request_id", "") or request_id_var.get()
        return True


class JsonFormatter(logging.Formatter):
    def __init__(self, process_name: str):
        super().__init__()
        self.process_name = process_name

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
                 "level": record.levelname, "process": self.process_name, "logger": record.name,
                 "message": record.getMessage()}
        if record.request_id:
            entry["request_id"] = record.request_id
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure(level: str, fmt: str, process_name: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RequestIdFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter(process_name))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # `kill -USR1 <pid>` writes every thread's Python stack to stderr: what a process that does
    # not stop (or answers nothing) is waiting on, without a debugger in the container.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
