"""structlog JSON logs; `request_id` and `tenant` are bound per request via contextvars."""

from __future__ import annotations

import logging
import sys

import structlog


def configure(service: str, level: str = "info") -> None:
    logging.basicConfig(stream=sys.stderr, level=level.upper(), format="%(message)s")
    # Libraries' own loggers stay quiet unless something is wrong.
    for noisy in ("uvicorn.access", "nats", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)


def get(name: str | None = None) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)
