"""Logging for the API, the worker and cron: plain text, or with FANOUT_LOG_FORMAT=json
(`--log-json`) one JSON object per line: time, level, logger, message, `job_id` on every
line that concerns one job, and any other `extra=` fields.

Where the job id comes from: the worker logs a job's lines through `JobLog`, and rq's lines
about a job inside `about(job_id)`; the API sets `job_id` (a context variable) for the
request in hand, which its access line then carries.
"""
from __future__ import annotations

import contextvars
import json
import logging
import os
from contextlib import contextmanager
from datetime import datetime, timezone

TEXT_FORMAT = "%(asctime)s %(name)s %(message)s"

# The job the lines logged now concern: the API's request in hand (its path names it, or a
# submit made it), or the worker's call into rq about one job.
job_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("job_id", default=None)

# Attributes every record has; the rest came with `extra=`. uvicorn's color_message repeats
# the message with terminal colors.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "color_message"}


def json_enabled() -> bool:
    return os.environ.get("FANOUT_LOG_FORMAT", "").lower() == "json"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        when = datetime.fromtimestamp(record.created, timezone.utc)
        out = {"time": when.isoformat(timespec="milliseconds"), "level": record.levelname,
               "logger": record.name, "message": record.getMessage()}
        jid = job_id.get()
        if jid is not None:
            out["job_id"] = jid
        out.update((k, v) for k, v in vars(record).items() if k not in _STANDARD)
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def setup() -> None:
    """The root logger at INFO, in the format FANOUT_LOG_FORMAT asks for."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if json_enabled() else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    if json_enabled():
        logging.captureWarnings(True)  # library warnings as JSON lines too, not bare stderr text


def uvicorn_config() -> dict:
    """uvicorn's log_config for JSON lines: its own loggers, the access log and the app's."""
    handler = {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}
    return {"version": 1, "disable_existing_loggers": False,
            "formatters": {"json": {"()": "jobs.logs.JsonFormatter"}},
            "handlers": {"default": handler},
            "loggers": {name: {"handlers": ["default"], "level": "INFO", "propagate": False}
                        for name in ("uvicorn", "uvicorn.access")},
            "root": {"handlers": ["default"], "level": "INFO"}}


@contextmanager
def about(jid: str):
    """Every line logged inside (by any library) is about job `jid`."""
    token = job_id.set(jid)
    try:
        yield
    finally:
        job_id.reset(token)


class JobLog(logging.LoggerAdapter):
    """`job ID: message` lines, with the id as structured data (`job_id`)."""

    def __init__(self, logger: logging.Logger, jid: str):
        super().__init__(logger, {"job_id": jid})

    def process(self, msg, kwargs):
        prefix = "job " + self.extra["job_id"].replace("%", "%%") + ": "
        return prefix + msg, {**kwargs, "extra": {**self.extra, **kwargs.get("extra", {})}}
