"""sdforge.ingest.url_credentials: a URL's userinfo redacted for storing, dropped for requesting, nothing else."""

from __future__ import annotations

import polars as pl
import pytest

from sdforge.ingest.url_credentials import is_redacted, redact_userinfo, redacted, without_userinfo

SECRET = "s3cr3t-Pa55"


@pytest.mark.parametrize(
    ("url", "stored", "requested"),
    [
        (f"http://user:{SECRET}@h.com/x.jpg", "http://***@h.com/x.jpg", "http://h.com/x.jpg"),
        (f"HTTPS://{SECRET}@H.com:8443/x", "HTTPS://***@H.com:8443/x", "HTTPS://H.com:8443/x"),
        (f"http://a@b:{SECRET}@h.com/x?q=1", "http://***@h.com/x?q=1", "http://h.com/x?q=1"),
        ("https://medium.com/@someone/post.jpg", "https://medium.com/@someone/post.jpg", None),  # a path's @ stays
        ("http://h.com/x?next=http://u:p@z/", "http://h.com/x?next=http://u:p@z/", None),  # not this URL's userinfo
    ],
)
def test_userinfo_is_redacted_for_storing_and_dropped_for_requesting(url, stored, requested):
    assert redact_userinfo(url) == stored
    assert without_userinfo(url) == (requested or url)
    frame = pl.DataFrame({"url": [url, None]}).select(redacted(pl.col("url")).alias("url"))
    assert frame["url"].to_list() == [stored, None]  # the polars expression the filter uses agrees
    assert frame.select(is_redacted(pl.col("url")))["url"].to_list() == [requested is not None, False]
