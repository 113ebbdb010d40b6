"""structlog set-up shared by the daemons: JSON lines on stderr, one logger per daemon.

Everything ends up as one JSON object per line: structlog's own events, and records of the
standard `logging` module (grpc's, transformers', Python warnings), which are routed through
the same renderer with the daemon's name added.
"""

from __future__ import annotations

import enum
import logging
import sys
import threading
import time

import structlog


def configure(daemon: str, level: str = "info") -> structlog.stdlib.BoundLogger:
    numeric = getattr(logging, level.upper())
    timestamper = structlog.processors.TimeStamper(fmt="iso", utc=True)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            timestamper,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(default=_json_default),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    _route_stdlib_logging(daemon, numeric, timestamper)
    return structlog.get_logger(daemon=daemon)


def _json_default(value: object) -> object:
    """A log field JSON has no type for: an enum as its value (`"role": "both"`), anything
    else as its repr (structlog's default)."""
    if isinstance(value, enum.Enum):
        return value.value
    return repr(value)


def _route_stdlib_logging(daemon: str, level: int, timestamper) -> None:
    def add_daemon(_, __, event: dict) -> dict:
        event.setdefault("daemon", daemon)
        return event

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.add_log_level, structlog.stdlib.add_logger_name, timestamper, add_daemon],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, structlog.processors.format_exc_info,
                    structlog.processors.JSONRenderer(default=_json_default)],
    ))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.captureWarnings(True)
    if "transformers" in sys.modules:  # it installs its own plain-text handler
        from transformers.utils import logging as hf_logging

        hf_logging.disable_default_handler()
        hf_logging.enable_propagation()


class RateLimitedLog:
    """One warning line per `interval_s` for an event a client can repeat at will (a refused
    connection or call, a malformed request or message), with how many were not logged since
    the last line: a flood costs a counter, never a line each."""

    def __init__(self, log, event: str, interval_s: float = 10.0) -> None:
        self._log, self._event, self._interval_s = log, event, interval_s
        self._last, self._unlogged = -interval_s, 0
        self._lock = threading.Lock()

    def note(self, **fields) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._last < self._interval_s:
                self._unlogged += 1
                return
            self._last, unlogged, self._unlogged = now, self._unlogged, 0
        self._log.warning(self._event, not_logged_since_last=unlogged, **fields)
