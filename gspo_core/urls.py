"""Credentials in URLs (``https://user:pass@host/...``) hidden wherever a URL is shown back or logged."""

from __future__ import annotations

import re

#: A scheme, ``://`` and an authority's userinfo: everything up to its last ``@`` before the path, query,
#: fragment or the text's next blank (a userinfo may hold an unencoded ``@``; a host never does).
_USERINFO_RE = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://)[^/?#\s]*@")
USERINFO_REDACTED = "[redacted]@"


def redact_userinfo(text: str) -> str:
    """``text`` with the userinfo of every URL in it replaced by ``[redacted]``; the rest unchanged."""
    return _USERINFO_RE.sub(lambda m: m.group(1) + USERINFO_REDACTED, text) if "@" in text else text
