"""SSRF guard: address classes, schemes, the guarded opener against real loopback servers, and img2dataset's workers."""

from __future__ import annotations

import collections
import contextlib
import ipaddress
import socket
import urllib.error
import urllib.request
from pathlib import Path

import cv2
import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest

from sdforge.config import FetchSettings, Source
from sdforge.demo.http_server import serve_directory
from sdforge.ingest import url_guard
from sdforge.ingest.url_guard import GuardPolicy, UrlGuardError
from stages import fetch_images


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


HAS_IPV6 = _ipv6_loopback()


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("8.8.8.8", None),
        ("93.184.216.34", None),
        ("2606:4700:4700::1111", None),
        ("::ffff:8.8.8.8", None),  # IPv4-mapped public
        ("64:ff9b::808:808", None),  # NAT64 of a public address
        ("127.0.0.1", "loopback"),
        ("127.255.0.9", "loopback"),
        ("::1", "loopback"),
        ("::ffff:127.0.0.1", "loopback"),  # IPv4-mapped
        ("2002:7f00:1::", "loopback"),  # 6to4 of 127.0.0.1
        ("10.0.0.1", "private"),
        ("172.16.5.4", "private"),
        ("192.168.1.1", "private"),
        ("fc00::1", "private"),
        ("64:ff9b::a00:1", "private"),  # NAT64 of 10.0.0.1
        ("169.254.169.254", "link-local"),  # cloud metadata
        ("::ffff:169.254.169.254", "link-local"),
        ("fe80::1", "link-local"),
        ("fe80::1%1", "link-local"),
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("::ffff:0.0.0.0", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
        ("240.0.0.1", "reserved"),
        ("255.255.255.255", "reserved"),
        ("100.64.0.1", "non-global"),  # carrier-grade NAT
    ],
)
def test_address_kind(address, kind):
    assert url_guard.address_kind(ipaddress.ip_address(address)) == kind


def test_allow_networks_let_exactly_their_ranges_through():
    policy = GuardPolicy(("127.0.0.0/8", "10.1.0.0/16", "169.254.169.254/32"))
    assert policy.refusal("127.0.0.1") is None
    assert policy.refusal("::ffff:127.0.0.2") is None  # mapped: judged as the IPv4 address
    assert policy.refusal("::1") == "loopback"  # an IPv4 range does not cover IPv6 loopback
    assert policy.refusal("10.1.2.3") is None
    assert policy.refusal("10.2.0.1") == "private"
    assert policy.refusal("169.254.169.254") is None
    assert policy.refusal("169.254.169.253") == "link-local"
    assert policy.refusal("0.0.0.0") == "unspecified"
    assert policy.refusal("8.8.8.8") is None
    assert GuardPolicy().refusal("127.0.0.1") == "loopback"
    assert GuardPolicy(("::1/128", "0.0.0.0/32")).refusal("::1") is None
    assert GuardPolicy(("::1/128", "0.0.0.0/32")).refusal("0.0.0.0") is None


@pytest.mark.parametrize(
    "url",
    [
        "file:///etc/passwd",
        "FILE:///etc/passwd",
        "ftp://example.com/a.jpg",
        "data:image/png;base64,iVBORw0KGgo=",
        "gopher://example.com/",
        "javascript:alert(1)",
        "example.com/a.jpg",
        "//example.com/a.jpg",
        "",
        "http:///no-host",
        None,
        42,
    ],
)
def test_scheme_refusal_refuses_everything_but_http_and_https(url):
    assert url_guard.scheme_refusal(url).startswith(url_guard.REFUSED_SCHEME)


@pytest.mark.parametrize("url", ["http://example.com/a.jpg", "HTTPS://Example.com/a", " http://a.b/c "])
def test_scheme_refusal_passes_http_urls(url):
    assert url_guard.scheme_refusal(url) is None


def test_guarded_connection_never_connects_to_a_refused_address():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.2)
        port = listener.getsockname()[1]
        with pytest.raises(UrlGuardError, match=r"127\.0\.0\.1 \(loopback\)"):
            url_guard.guarded_create_connection(GuardPolicy(), ("127.0.0.1", port), 2)
        with pytest.raises(UrlGuardError, match=r"'localhost': resolves to 127\.0\.0\.1 \(loopback\)"):
            url_guard.guarded_create_connection(GuardPolicy(), ("localhost", port), 2)
        with pytest.raises(TimeoutError):
            listener.accept()  # nothing ever connected
        sock = url_guard.guarded_create_connection(GuardPolicy(("127.0.0.1/32",)), ("localhost", port), 2)
        with sock:
            peer, _ = listener.accept()
            peer.close()
            assert sock.getpeername() == ("127.0.0.1", port)


def test_guarded_connection_keeps_only_the_allowed_answers_of_a_mixed_resolution(monkeypatch):
    """A name resolving to a refused and an allowed address connects to the allowed one only."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        answers = [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.1", port)),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port)),
        ]
        monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: answers)
        with url_guard.guarded_create_connection(GuardPolicy(("127.0.0.0/8",)), ("mixed.test", port), 2) as sock:
            assert sock.getpeername() == ("127.0.0.1", port)
        with pytest.raises(UrlGuardError, match=r"10\.0\.0\.1 \(private\), 127\.0\.0\.1 \(loopback\)"):
            url_guard.guarded_create_connection(GuardPolicy(), ("mixed.test", port), 2)


def test_plain_urllib_opens_file_urls_but_the_guarded_opener_does_not(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    assert urllib.request.build_opener().open(secret.as_uri()).read() == b"s3cret"  # the threat
    opener = url_guard.build_opener(GuardPolicy(("0.0.0.0/0",)))
    for url in (secret.as_uri(), "ftp://127.0.0.1/x", "data:text/plain;base64,czNjcmV0", "gopher://127.0.0.1/"):
        with pytest.raises(urllib.error.URLError, match=url_guard.REFUSED_SCHEME):
            opener.open(url, timeout=2)


@pytest.fixture
def www(tmp_path: Path) -> Path:
    root = tmp_path / "www"
    root.mkdir()
    (root / "a.txt").write_bytes(b"from a")
    return root


def test_guarded_opener_against_listening_servers(www, tmp_path):
    """Loopback, localhost, 0.0.0.0 and [::1] reach nothing by default and exactly their server when allowed."""
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    hits_a, hits_b = collections.Counter(), collections.Counter()
    with serve_directory(www, 0, "127.0.0.2", hits=hits_b) as base_b:
        redirects = {"/to-b": f"{base_b}/a.txt", "/to-file": secret.as_uri()}
        with serve_directory(www, 0, hits=hits_a, redirects=redirects) as base_a:
            port = base_a.rsplit(":", 1)[1]
            urls = [
                f"{base_a}/a.txt",
                f"http://localhost:{port}/a.txt",
                f"http://0.0.0.0:{port}/a.txt",
                f"{base_b}/a.txt",
            ]
            for url in urls + [f"{base_a}/to-b"]:
                with pytest.raises(urllib.error.URLError, match=url_guard.REFUSED_ADDRESS):
                    url_guard.build_opener(GuardPolicy()).open(url, timeout=5)
            assert hits_a == {} and hits_b == {}

            # allowed: 127.0.0.1 only; the redirect to 127.0.0.2 is refused at the second hop
            only_a = url_guard.build_opener(GuardPolicy(("127.0.0.1/32",)))
            assert only_a.open(f"{base_a}/a.txt", timeout=5).read() == b"from a"
            assert only_a.open(f"http://localhost:{port}/a.txt", timeout=5).read() == b"from a"
            with pytest.raises(urllib.error.URLError, match=r"refused address '127\.0\.0\.2'"):
                only_a.open(f"{base_a}/to-b", timeout=5)
            with pytest.raises(urllib.error.URLError, match=r"refused scheme 'file' .* in a redirect from"):
                only_a.open(f"{base_a}/to-file", timeout=5)
            with pytest.raises(urllib.error.URLError, match=r"0\.0\.0\.0 \(unspecified\)"):
                only_a.open(f"http://0.0.0.0:{port}/a.txt", timeout=5)
            assert hits_a == {"/a.txt": 2, "/to-b": 1, "/to-file": 1} and hits_b == {}

            loopback = url_guard.build_opener(GuardPolicy(("127.0.0.0/8", "0.0.0.0/32")))
            assert loopback.open(f"{base_a}/to-b", timeout=5).read() == b"from a"
            assert loopback.open(f"http://0.0.0.0:{port}/a.txt", timeout=5).read() == b"from a"
            assert hits_b == {"/a.txt": 1} and hits_a["/a.txt"] == 3


@pytest.mark.skipif(not HAS_IPV6, reason="no IPv6 loopback")
def test_guarded_opener_ipv6_loopback(www):
    hits = collections.Counter()
    with serve_directory(www, 0, "::1", hits=hits) as base:
        with pytest.raises(urllib.error.URLError, match=r"::1 \(loopback\)"):
            url_guard.build_opener(GuardPolicy(("127.0.0.0/8",))).open(f"{base}/a.txt", timeout=5)
        assert hits == {}
        assert url_guard.build_opener(GuardPolicy(("::1/128",))).open(f"{base}/a.txt", timeout=5).read() == b"from a"
        assert hits == {"/a.txt": 1}


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        ("url_guard: refused scheme 'file' (only http and https are fetched)", "refused_scheme"),
        ("<urlopen error url_guard: refused address '10.0.0.1': resolves to ...>", "refused_ssrf"),
        ("HTTP Error 404: File not found", "error_http"),
        ("HTTP Error 500: Internal Server Error", "error_http"),
        ("<urlopen error [Errno 111] Connection refused>", "error_network"),
        ("<urlopen error [Errno -2] Name or service not known>", "error_network"),
        ("timed out", "error_network"),
        ("IncompleteRead(10 bytes read, 90 more expected)", "error_network"),
        ("Image decoding error", "error_decode"),
        (
            "OpenCV(5.0.0) loadsave.cpp:1291: error: (-215:Assertion failed) !buf.empty() in function 'imdecode_'",
            "error_decode",
        ),
        (
            "OpenCV(5.0.0) loadsave.cpp:79: error: (-215:Assertion failed) pixels <= CV_IO_MAX_IMAGE_PIXELS",
            "error_too_many_pixels",
        ),
        ("image area too large", "error_too_many_pixels"),
        ("Use of image disallowed by X-Robots-Tag directive", "error_robots"),
        ("something else", "error_other"),
        (None, "error_other"),
    ],
)
def test_failure_reason(message, reason):
    assert url_guard.failure_reason(message) == reason
    assert reason in url_guard.REASONS


def _fetch(rows: list[str], tmp_path: Path, out: str, allow: list[str]) -> tuple[dict, dict[str, dict]]:
    filtered = tmp_path / "filtered"
    filtered.mkdir(exist_ok=True)
    pl.DataFrame({"url": rows, "caption": [f"row {i}" for i in range(len(rows))]}).write_parquet(
        filtered / "filtered.parquet"
    )
    fetch = FetchSettings(image_size=16, processes=1, threads=4, timeout=5, shard_size=100, allow_networks=allow)
    metrics = fetch_images.run(
        Source(kind="laion", repo="unused", fetch=fetch), "t", filtered, tmp_path, tmp_path / out
    )
    table = pq.read_table(tmp_path / out / "00000.parquet").to_pylist()
    return metrics, {row["url"]: row for row in table}


def test_img2dataset_workers_fetch_only_through_the_guard(tmp_path, www):
    """The guard runs in img2dataset's spawned workers: refused rows never reach a (listening) server."""
    cv2.imwrite(str(www / "ok.png"), np.full((20, 20, 3), 200, np.uint8))
    hits, hits_b, hits_6 = collections.Counter(), collections.Counter(), collections.Counter()
    with contextlib.ExitStack() as stack:
        base_b = stack.enter_context(serve_directory(www, 0, "127.0.0.2", hits=hits_b))
        base = stack.enter_context(serve_directory(www, 0, hits=hits, redirects={"/redirect": f"{base_b}/ok.png"}))
        six = [f"{stack.enter_context(serve_directory(www, 0, '::1', hits=hits_6))}/ok.png"] if HAS_IPV6 else []
        port = base.rsplit(":", 1)[1]
        rows = [
            f"{base}/ok.png",
            f"http://localhost:{port}/ok.png",
            f"http://0.0.0.0:{port}/ok.png",
            *six,
            "http://10.0.0.1/ok.png",
            "http://169.254.169.254/latest/meta-data/",
            f"{base}/redirect",
            "file:///etc/passwd",
        ]
        metrics, by_url = _fetch(rows, tmp_path, "default", [])
        assert hits == {} and hits_b == {} and hits_6 == {}
        assert (metrics["samples"], metrics["successes"]) == (len(rows), 0)
        assert (metrics["refused_ssrf"], metrics["refused_scheme"]) == (len(rows) - 1, 1)
        for row in by_url.values():
            assert row["status"] == "failed_to_download"
            assert row["error_message"].startswith(("<urlopen error url_guard: refused address", "url_guard: refused"))
        assert "169.254.169.254 (link-local)" in by_url["http://169.254.169.254/latest/meta-data/"]["error_message"]

        metrics, by_url = _fetch(rows, tmp_path, "allowed", ["127.0.0.1/32", "0.0.0.0/32", "::1/128"])
        fetched = {url for url, row in by_url.items() if row["status"] == "success"}
        assert fetched == set(rows[:3] + six)
        assert hits == {"/ok.png": 3, "/redirect": 1} and hits_6 == ({"/ok.png": 1} if six else {})
        assert hits_b == {}  # the redirect's target (127.0.0.2) is not allowed
        assert "refused address '127.0.0.2'" in by_url[f"{base}/redirect"]["error_message"]
        assert (metrics["refused_ssrf"], metrics["refused_scheme"], metrics["successes"]) == (3, 1, len(fetched))
