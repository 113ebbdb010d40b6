"""structlog set-up shared by the daemons: JSON lines on stderr, one logger per daemon."""

from __future__ import annotations

import logging
import sys

import structlog


def configure(daemon: str, level: str = "info") -> structlog.stdlib.BoundLogger:
    logging.basicConfig(stream=sys.stderr, level=getattr(logging, level.upper()), format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    return structlog.get_logger(daemon=daemon)
