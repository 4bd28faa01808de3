"""Log lines: one line per event, whatever a client, a model or a service put in them."""

from __future__ import annotations

import logging
import re

from .shown import without_secrets

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
HTTP_LOGGERS = ("httpx", "httpx2", "httpcore", "httpcore2", "openai", "ollama")
"""The model SDKs and their HTTP stacks: a line per request at INFO. Shown at DEBUG only."""
CLIENT_LOGGERS = ("engineio.client", "socketio.client")
SERVER_LOGGERS = ("engineio.server", "socketio.server")
"""python-socketio's and python-engineio's loggers (see ``configure_logging``)."""

CONTROLS = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")
"""Characters that would break a log line or drive the terminal showing it: line breaks (a
forged line after them), escape sequences (a cleared screen), the other C0 and C1 controls."""


def one_line(text: str) -> str:
    """``text`` with each control character written as its escape (``\\n``, ``\\x1b``)."""
    if CONTROLS.search(text) is None:
        return text
    return CONTROLS.sub(lambda found: repr(found.group())[1:-1], text)


class OneLine(logging.Formatter):
    """``LOG_FORMAT`` with the message on one line: a tool's name a model chose, a service's
    error or a client's input cannot add a line of its own, or an escape sequence, to the log.
    A traceback still follows its line, as it is. A URL's password is left out (a relay behind
    a proxy that asks for one, a database's), and so are tokens (the transport's lines at
    DEBUG hold every connect's)."""

    def __init__(self) -> None:
        super().__init__(LOG_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = one_line(without_secrets(record.message))
        return super().formatMessage(record)


class TransportNotes(logging.Filter):
    """What python-socketio's client says about its connection is DEBUG.

    It logs a connection that went away as an ERROR ("packet queue is empty, aborting" when
    a relay stops answering), and the drone logs what that means itself, in its own words. A
    handler's exception, logged with its traceback, keeps its level.
    """

    def __init__(self, shown: int) -> None:
        super().__init__()
        self.shown = shown

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info is None:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return record.levelno >= self.shown


def configure_logging(level: str) -> None:
    """One format for every line, the libraries' per-request chatter only at DEBUG.

    Call before a socket.io client or server exists: python-socketio gives a logger whose level
    is not set a handler of its own, which writes unformatted lines across the drone's status
    line.
    """
    handler = logging.StreamHandler()
    handler.setFormatter(OneLine())
    logging.basicConfig(level=level, handlers=[handler])
    logging.captureWarnings(True)
    shown = logging.getLevelName(level)
    debug = shown <= logging.DEBUG
    for name in HTTP_LOGGERS:
        logging.getLogger(name).setLevel(logging.DEBUG if debug else logging.WARNING)
    for name in (*CLIENT_LOGGERS, *SERVER_LOGGERS):
        logging.getLogger(name).setLevel(logging.DEBUG if debug else logging.ERROR)
    for name in CLIENT_LOGGERS:
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, TransportNotes)]:
            logger.removeFilter(old)
        logger.addFilter(TransportNotes(shown))
