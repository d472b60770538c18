"""Credentials in metadata URLs (``http://user:secret@host/x.jpg``): never stored, never sent.

A row's URL is untrusted text and may carry userinfo. The LAION filter stores every URL with its userinfo
replaced by ``***`` (``http://***@host/x.jpg``, :func:`redacted`) and counts those rows
(``urls_credentials_redacted``), so ``filtered.parquet`` and every copy after it (the shard parquets, each sample's
``.json``, the DVC remote) hold no secret. The fetch requests every URL without userinfo (:func:`without_userinfo`):
credentials in a URL are never sent (urllib never sent them either: it took ``user:secret@host`` for a host name,
which did not resolve), and it refuses a ``filtered.parquet`` that still holds any (one this filter did not write).

Userinfo is what RFC 3986 calls it: between ``scheme://`` and the last ``@`` before the path, query or fragment.
An ``@`` in a path (``https://medium.com/@user/post``) is not userinfo and stays. A secret holding a raw ``/`` is
not userinfo by that grammar either (the URL names host ``user:sec``, which no fetch reaches); it is not redacted.
Not :func:`sdforge.config.base.redact_credentials`: that one redacts config values and error text, where it
rather over-redacts (an ``@`` in a path too); here the URL is data, and a path's ``@`` must survive intact.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import polars as pl

USERINFO = r"^(\s*[A-Za-z][A-Za-z0-9+.\-]*://)[^/?#]*@"
"""``scheme://`` (group 1) and the userinfo after it, up to the authority's last ``@`` (Python and Rust regex)."""
REDACTED = "***"
REDACTED_USERINFO = r"^\s*[A-Za-z][A-Za-z0-9+.\-]*://\*\*\*@"
"""A URL as :func:`redacted` leaves one that had userinfo."""
_USERINFO = re.compile(USERINFO)


def redact_userinfo(url: str) -> str:
    """``url`` with its userinfo, if any, replaced by ``***``."""
    return _USERINFO.sub(rf"\g<1>{REDACTED}@", url, count=1)


def without_userinfo(url: str) -> str:
    """``url`` without userinfo (what the fetch requests)."""
    return _USERINFO.sub(r"\g<1>", url, count=1)


def redacted(url: pl.Expr) -> pl.Expr:
    """Polars: :func:`redact_userinfo` of a string column (the regex runs only on the URLs holding an ``@``)."""
    import polars as pl  # lazy: the fetch workers import this module for without_userinfo, and need no polars

    has_at = url.str.contains("@", literal=True).fill_null(False)
    return pl.when(has_at).then(url.str.replace(USERINFO, f"${{1}}{REDACTED}@")).otherwise(url)


def is_redacted(url: pl.Expr) -> pl.Expr:
    """Polars: whether each URL of a string column holds redacted userinfo (False for null)."""
    return url.str.contains(REDACTED_USERINFO).fill_null(False)
