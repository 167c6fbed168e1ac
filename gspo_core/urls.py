"""Credentials in URLs (``https://user:pass@host/...``) hidden wherever a URL is shown back or logged."""

from __future__ import annotations

import logging
import re

#: A scheme, ``://`` and an authority's userinfo: everything up to its last ``@`` before the path, query,
#: fragment or the text's next blank (a userinfo may hold an unencoded ``@``; a host never does).
_USERINFO_RE = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://)[^/?#\s]*@")
USERINFO_REDACTED = "[redacted]@"


def redact_userinfo(text: str) -> str:
    """``text`` with the userinfo of every URL in it replaced by ``[redacted]``; the rest unchanged."""
    return _USERINFO_RE.sub(lambda m: m.group(1) + USERINFO_REDACTED, text) if "@" in text else text


def redact_logged_userinfo() -> None:
    """From now on, every log record of this process has its URLs' userinfo redacted, its traceback included:
    libraries log the URLs they call (httpx at INFO: ``HTTP Request: POST https://user:pass@...``). Set on the
    record factory, so it holds whatever handlers the process's logging has (uvicorn's, Celery's). Idempotent."""
    current = logging.getLogRecordFactory()
    if getattr(current, "redacts_userinfo", False):
        return

    def factory(*args, **kwargs) -> logging.LogRecord:
        record = current(*args, **kwargs)
        message = record.getMessage()
        if "@" in message:
            record.msg, record.args = redact_userinfo(message), None
        if record.exc_info and record.exc_info[0] is not None:
            record.exc_text = redact_userinfo(logging.Formatter().formatException(record.exc_info))
        return record

    factory.redacts_userinfo = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)
