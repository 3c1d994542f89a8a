"""The one way a database URL is shown: with its password masked.

Every path that writes a URL (logs, check-config, status, errors) goes
through ``mask_url``, so there is one place to get right.
"""

from __future__ import annotations

import re

# scheme://user:password@host -> scheme://user:***@host; also catches a
# password given as a query parameter.
_USERINFO = re.compile(r"^(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^:/@?#]*):(?P<secret>[^/]*)@")
_QUERY = re.compile(r"(?P<head>[?&](?:password|passwd|pwd)=)(?P<secret>[^&#]*)", re.IGNORECASE)


def mask_url(url: str) -> str:
    masked = _USERINFO.sub(lambda m: f"{m['head']}:***@", url)
    return _QUERY.sub(lambda m: f"{m['head']}***", masked)


def mask_in(text: str, url: str | None) -> str:
    """Remove ``url``'s password from arbitrary text, such as a driver's error."""
    if not url:
        return text
    match = _USERINFO.match(url)
    secret = match["secret"] if match else ""
    if secret:
        text = text.replace(url, mask_url(url)).replace(secret, "***")
    return text


# Any URL with a password, anywhere in a text.
_ANY_USERINFO = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^:/@\s]*):(?P<secret>[^@/\s]*)@")


def mask_text(text: str) -> str:
    """Mask the password of every URL in ``text``, when the URL itself is not known."""
    return _ANY_USERINFO.sub(lambda m: f"{m['head']}:***@", text)
