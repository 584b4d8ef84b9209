"""structlog set-up: JSON when not on a terminal (containers), pretty output on one."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

import structlog

from nanovllm.common.options import option


@dataclass
class LogConfig:
    log_level: str = option("info", help="debug, info, warning or error")
    log_format: str = option("auto", help="json, console, or auto (json unless stderr is a terminal)")

    def apply(self) -> None:
        fmt = self.log_format
        configure_logging(self.log_level, json=None if fmt == "auto" else fmt == "json", stdlib=True)


def configure_logging(level: str = "INFO", json: bool | None = None, stdlib: bool = False) -> None:
    """Configure structlog once for a process; library code only calls get_logger().

    With `stdlib`, records of the standard logging module (asyncio's "Task exception was never retrieved",
    grpc's own) are rendered the same way, so a server's stderr stays one JSON object per line. Only the
    servers ask for it: the offline API leaves its host program's logging alone."""
    if json is None:
        json = not sys.stderr.isatty()
    if json:
        # exc_info becomes an "exception" field: type, message and frames of each exception in the chain
        # (without the frames' local variables, which may hold prompts or whole tensors).
        exceptions = structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
        renderers: list[structlog.typing.Processor] = [
            structlog.processors.ExceptionRenderer(exceptions),
            structlog.processors.JSONRenderer(),
        ]
    else:
        renderers = [structlog.dev.ConsoleRenderer()]  # prints exc_info as a traceback itself
    stamp: list[structlog.typing.Processor] = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso"),
    ]
    level_number = logging.getLevelName(level.upper())
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, *stamp, *renderers],
        wrapper_class=structlog.make_filtering_bound_logger(level_number),
        # One write per line (print writes the line and its newline apart): the processes of a router
        # share one log file, and a line must not take another's newline between its two writes.
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    if stdlib:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(
            structlog.stdlib.ProcessorFormatter(
                foreign_pre_chain=[structlog.stdlib.add_logger_name, *stamp],
                processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *renderers],
            )
        )
        root = logging.getLogger()
        root.handlers = [handler]
        root.setLevel(level_number)


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    """A named logger. A process that never configured logging gets warnings and errors on stderr
    only, so importing the library never prints to stdout."""
    if not structlog.is_configured():
        configure_logging(level="WARNING")
    return structlog.get_logger(name)
