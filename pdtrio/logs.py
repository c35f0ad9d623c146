"""Log lines: a timestamp, which process, the level, the logger, the message.

Every pdtrio process (the router and each worker, embedded or not) calls
``configure_logging`` once at start, so the lines of a router and of the workers it
started, which share a terminal, are told apart by their label: ``router``, or the
worker's instance id. ``text`` is for people, ``json`` (one object a line, with any
``extra=`` fields as keys) for log collectors. Request content (prompts, generated
text) is only ever logged at DEBUG.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Mapping
from typing import Any, Final, Literal, TextIO, final, get_args

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[str, ...] = get_args(LogFormat)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_LEVEL_ENV = "PDTRIO_LOG_LEVEL"
LOG_FORMAT_ENV = "PDTRIO_LOG_FORMAT"
DEFAULT_LOG_LEVEL = "INFO"
DEFAULT_LOG_FORMAT: LogFormat = "text"

# what every LogRecord carries: anything else on a record came from ``extra=``
_RECORD_ATTRIBUTES = frozenset(
    vars(logging.LogRecord("", logging.INFO, "", 0, "", None, None, None))
) | {"message", "asctime", "taskName"}


class LogSettingError(ValueError):
    """A log level or format that is not one of the known ones."""


# the last timestamp's second and its text (lines come many to a second); one tuple,
# replaced whole, so a line logged from another thread never pairs one's text with another
_last_second: tuple[int, str] = (-1, "")


def timestamp(created: float) -> str:
    """``2026-12-01T04:50:00.123Z``: UTC, milliseconds."""
    global _last_second
    seconds = int(created)
    millis = int((created - seconds) * 1000)
    last = _last_second
    if last[0] != seconds:
        last = _last_second = (seconds, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)))
    return f"{last[1]}.{millis:03d}Z"


@final
class TextFormatter(logging.Formatter):
    """``2026-12-01T04:50:00.123Z router INFO pdtrio.router: message``"""

    def __init__(self, process_label: str) -> None:
        super().__init__()
        self.process_label = process_label

    def format(self, record: logging.LogRecord) -> str:
        line = self._line(record.created, record.levelname, record.name, record.getMessage())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line

    def format_access(self, created: float, message: str, fields: Mapping[str, Any]) -> str:
        """What ``format`` makes of an INFO access record with this message."""
        return self._line(created, "INFO", ACCESS_LOGGER, message)

    def _line(self, created: float, level: str, logger: str, message: str) -> str:
        return f"{timestamp(created)} {self.process_label} {level} {logger}: {message}"


@final
class JsonFormatter(logging.Formatter):
    """One JSON object a line: ts, process, level, logger, message, then ``extra`` fields."""

    def __init__(self, process_label: str) -> None:
        super().__init__()
        self.process_label = process_label

    def format(self, record: logging.LogRecord) -> str:
        fields = self._fields(
            record.created, record.levelname, record.name, record.getMessage(), vars(record)
        )
        if record.exc_info:
            fields["exception"] = self.formatException(record.exc_info)
        return json.dumps(fields, default=str, ensure_ascii=False)

    def format_access(self, created: float, message: str, fields: Mapping[str, Any]) -> str:
        """What ``format`` makes of an INFO access record with this message and extra."""
        line = self._fields(created, "INFO", ACCESS_LOGGER, message, fields)
        return json.dumps(line, default=str, ensure_ascii=False)

    def _fields(
        self, created: float, level: str, logger: str, message: str, extra: Mapping[str, Any]
    ) -> dict[str, Any]:
        """The line's object: its own fields, then those of ``extra`` no record has."""
        fields: dict[str, Any] = {
            "ts": timestamp(created),
            "process": self.process_label,
            "level": level,
            "logger": logger,
            "message": message,
        }
        for key, value in extra.items():
            if key not in _RECORD_ATTRIBUTES and key not in fields:
                fields[key] = value
        return fields


# Access lines wait in the handler until this many are pending, a line of another
# logger or of WARNING and above is written (they go first: the order is kept), or
# flush_access_log() is called (the router does, every ACCESS_LOG_FLUSH_INTERVAL_S).
ACCESS_LOGGER = "pdtrio.access"
ACCESS_LOG_BATCH_LINES: Final = 256
ACCESS_LOG_FLUSH_INTERVAL_S: Final = 0.5


@final
class _PdtrioHandler(logging.StreamHandler[TextIO]):
    """The root handler ``configure_logging`` installs (and replaces when called again).

    One write per access line was a system call per request (about a twentieth of
    the router's CPU per short request): access lines are written in batches, like
    nginx's buffered access log, at most a flush interval late.
    """

    def __init__(self, stream: TextIO) -> None:
        super().__init__(stream)
        self._pending: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name == ACCESS_LOGGER and record.levelno < logging.WARNING:
            try:
                self._pending.append(self.format(record))
            except Exception:  # noqa: BLE001 - logging's own contract: report, never raise
                self.handleError(record)
                return
            if len(self._pending) >= ACCESS_LOG_BATCH_LINES:
                self.flush()
            return
        if self._pending:
            self.flush()
        super().emit(record)

    def add_access_line(self, line: str) -> None:
        """A formatted access line, to go out with the batch."""
        self._pending.append(line)
        if len(self._pending) >= ACCESS_LOG_BATCH_LINES:
            self.flush()

    def flush(self) -> None:
        self.acquire()
        try:
            if self._pending:
                text = self.terminator.join(self._pending) + self.terminator
                self._pending.clear()
                try:
                    self.stream.write(text)
                except Exception:  # noqa: BLE001 - as StreamHandler.emit: report, never raise
                    self.handleError(
                        logging.LogRecord(ACCESS_LOGGER, logging.INFO, "", 0, text, None, None)
                    )
            super().flush()
        finally:
            self.release()


_access_logger = logging.getLogger(ACCESS_LOGGER)
_root_logger = logging.getLogger()


def log_access(message: str, fields: Mapping[str, Any]) -> None:
    """``pdtrio.access``'s INFO line ``message``, with ``fields`` as its ``extra``.

    When the line can only end in our handler's batch (no other handler, no
    filter on the way), it is formatted straight into it: the same line as
    ``logging`` would make, without a LogRecord and the frame walk (about a
    twentieth of the router's CPU per short request).
    """
    access, root = _access_logger, _root_logger
    if not access.isEnabledFor(logging.INFO):
        return
    handlers = root.handlers
    if (
        len(handlers) == 1
        and type(handler := handlers[0]) is _PdtrioHandler
        and not handler.filters
        and handler.level <= logging.INFO
        and not access.handlers
        and not access.filters
        and not root.filters
        and access.parent is root
        and access.propagate
        and isinstance(formatter := handler.formatter, TextFormatter | JsonFormatter)
    ):
        handler.add_access_line(formatter.format_access(time.time(), message, fields))
        return
    access.info(message, extra=fields)


def flush_access_log() -> None:
    """Write the access lines waiting in the installed handler (if any)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, _PdtrioHandler):
            handler.flush()


def parse_level(level: str) -> str:
    name = level.strip().upper()
    if name not in LOG_LEVELS:
        raise LogSettingError(f"log level {level!r} is not one of {', '.join(LOG_LEVELS)}")
    return name


def parse_format(fmt: str) -> LogFormat:
    name = fmt.strip().lower()
    if name == "json":
        return "json"
    if name == "text":
        return "text"
    raise LogSettingError(f"log format {fmt!r} is not one of {', '.join(LOG_FORMATS)}")


def settings_from_env(environ: Mapping[str, str]) -> tuple[str, LogFormat]:
    """``PDTRIO_LOG_LEVEL`` and ``PDTRIO_LOG_FORMAT`` (else INFO and text)."""
    level = parse_level(environ.get(LOG_LEVEL_ENV) or DEFAULT_LOG_LEVEL)
    fmt = parse_format(environ.get(LOG_FORMAT_ENV) or DEFAULT_LOG_FORMAT)
    return level, fmt


def configure_logging(
    level: str, fmt: LogFormat, process_label: str, *, stream: TextIO | None = None
) -> None:
    """Send every logger's records at ``level`` and above to stderr, formatted as ``fmt``.

    Replaces the handler an earlier call installed; other handlers (a test's capture)
    stay.
    """
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, _PdtrioHandler):
            root.removeHandler(handler)
            handler.flush()  # its waiting access lines
            handler.close()
    level = parse_level(level)
    handler = _PdtrioHandler(sys.stderr if stream is None else stream)
    formatter = JsonFormatter(process_label) if fmt == "json" else TextFormatter(process_label)
    handler.setFormatter(formatter)
    # on the handler too: a logger with its own level (hypercorn's) propagates past root's
    handler.setLevel(level)
    root.addHandler(handler)
    root.setLevel(level)
    # httpx logs every request it makes at INFO (the router's health probes): debugging only
    logging.getLogger("httpx").setLevel(logging.DEBUG if level == "DEBUG" else logging.WARNING)


@final
class LogBudget:
    """At most one record of a kind per ``interval_s``; the rest are counted, and the next
    record of that kind says how many were left out.

    For what peers cause (refused links, malformed bytes, connections that fail): an
    attacker can make as many of those as it likes, and must not be able to fill a disk.
    """

    def __init__(self, interval_s: float = 10.0, *, max_kinds: int = 256) -> None:
        self.interval_s = interval_s
        # kinds are the caller's constants, but a bound keeps a mistake from growing it
        self._max_kinds = max_kinds
        self._last_logged: dict[str, float] = {}
        self._left_out: dict[str, int] = {}

    def admit(self, kind: str, now: float | None = None) -> int | None:
        """None: leave this record out (counted). Else log it: the count left out since the
        last one of this kind is returned (0: none)."""
        now = time.monotonic() if now is None else now
        last = self._last_logged.get(kind)
        if last is not None and now - last < self.interval_s:
            self._left_out[kind] = self._left_out.get(kind, 0) + 1
            return None
        if last is None and len(self._last_logged) >= self._max_kinds:
            self._last_logged.clear()
            self._left_out.clear()
        self._last_logged[kind] = now
        return self._left_out.pop(kind, 0)

    def log(
        self, logger: logging.Logger, level: int, kind: str, message: str, *args: object
    ) -> bool:
        """``logger.log(level, message, *args)`` if the budget allows; True if it logged."""
        left_out = self.admit(kind)
        if left_out is None:
            return False
        if left_out:
            message += " (%d more like it in the last %.0f s were not logged)"
            args = (*args, left_out, self.interval_s)
        logger.log(level, message, *args)
        return True


def adopt_hypercorn_error_log() -> None:
    """hypercorn's error log (by default its own handler on stderr, another format) goes
    through ours instead; a log file it was given (``--error-logfile``) stays. Its
    tracebacks are budgeted: at most one a kind (the exception's type) per 10 s."""
    logger = logging.getLogger("hypercorn.error")
    if not any(isinstance(f, _HypercornErrorLogAdopter) for f in logger.filters):
        logger.addFilter(_HypercornErrorLogAdopter())
    _drop_stderr_handlers(logger)


@final
class _HypercornErrorLogAdopter(logging.Filter):
    """hypercorn gives its logger a stderr handler lazily, after the app has started: this
    filter drops it as each record passes, before the logger's handlers run."""

    def __init__(self) -> None:
        super().__init__()
        self._budget = LogBudget()

    def filter(self, record: logging.LogRecord) -> bool:
        _drop_stderr_handlers(logging.getLogger(record.name))
        if record.exc_info is None or record.exc_info[0] is None:
            return True
        left_out = self._budget.admit(record.exc_info[0].__qualname__, record.created)
        if left_out is None:
            return False
        if left_out:
            record.msg = f"{record.msg} ({left_out} more like it in the last 10 s were not logged)"
        return True


def _drop_stderr_handlers(logger: logging.Logger) -> None:
    for handler in list(logger.handlers):
        if type(handler) is logging.StreamHandler and handler.stream in (
            sys.stderr,
            sys.__stderr__,
        ):
            logger.removeHandler(handler)
    logger.propagate = True
