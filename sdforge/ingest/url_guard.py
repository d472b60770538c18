"""SSRF guard for the URL fetch: only http(s) URLs, only to public addresses (or ``allow_networks``).

A metadata row is untrusted input: its URL may name ``file:///etc/passwd`` (urllib would open it),
a cloud metadata endpoint (``http://169.254.169.254/``), a service on the private network, or a
public host name that resolves to any of those (or redirects there). The policy:

* **Scheme.** Only ``http`` and ``https``. Anything else (``file``, ``ftp``, ``data``, ``gopher``, no
  scheme, not a string) is refused before urllib sees it, with ``url_guard: refused scheme ...``;
  the opener the workers use has no file/ftp/data handler at all, and redirects to another scheme
  are refused the same way.
* **Address.** Every address a host name resolves to is classified; loopback, private,
  link-local (169.254.169.254 included), multicast, reserved, unspecified and other non-global
  addresses are refused, IPv4 and IPv6 alike, and an IPv6 address that embeds an IPv4 one
  (IPv4-mapped ``::ffff:a.b.c.d``, 6to4, NAT64) is judged by both. ``allow_networks`` (CIDRs;
  ``fetch.allow_networks`` in params.yaml) lets chosen ranges through, e.g. ``["127.0.0.0/8"]`` for
  the loopback demo. A host with no allowed address fails with ``url_guard: refused address ...``.
* **At connection time.** The check is in the connection itself (:func:`guarded_create_connection`
  replaces ``socket.create_connection`` for the opener's HTTP(S) connections): the name is
  resolved once, the allowed addresses are kept and the socket connects to exactly those, so a
  DNS answer that changes between a check and the connect (rebinding) cannot slip through, and
  every redirect hop goes through the same connection class. No proxy handler is installed
  (a proxy would resolve names itself, beyond the guard's reach).

Where it runs: img2dataset downloads in worker processes that it starts with *spawn* (or on
pyspark/ray executors). :class:`GuardedDownloader` subclasses img2dataset's ``Downloader``; its
``__call__`` (the per-shard entry point, run in the worker) first calls :func:`install`, which
installs the guarded opener as urllib's global opener and puts the scheme check in front of
img2dataset's ``download_image``, which then requests the URL without userinfo (credentials in a URL are never
sent: :mod:`sdforge.ingest.url_credentials`). :func:`guarded_img2dataset` substitutes the class for the one
``img2dataset.main`` constructs, so the pickled downloader brings this module into every worker.

The downloader also carries the stage's resizer (:class:`sdforge.ingest.image_convert.SampleResizer`) in place
of img2dataset's: the downloaded bytes are decoded by the same code as a local folder's images (header size
checked before any pixel, EXIF orientation, 16-bit, float/HDR refused), not by img2dataset's OpenCV decode.

Refusals are ordinary failed samples (status ``failed_to_download``, the message in
``error_message``); :func:`failure_reason` maps any error message to a metrics key.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import importlib
import ipaddress
import os
import socket
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urljoin, urlsplit

from img2dataset.downloader import Downloader

from sdforge.ingest.url_credentials import without_userinfo

REFUSED_SCHEME = "url_guard: refused scheme"
REFUSED_ADDRESS = "url_guard: refused address"
ALLOWED_SCHEMES = frozenset({"http", "https"})

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
_KINDS = (  # checked in this order; the first that applies names the refusal
    ("is_unspecified", "unspecified"),
    ("is_loopback", "loopback"),
    ("is_link_local", "link-local"),
    ("is_multicast", "multicast"),
    ("is_reserved", "reserved"),
    ("is_private", "private"),
)

REASONS = (
    "refused_scheme",
    "refused_ssrf",
    "error_http",
    "error_network",
    "error_decode",
    "error_too_many_pixels",
    "error_robots",
    "error_other",
)
"""Metrics keys for why a sample was not fetched (:func:`failure_reason`); they sum to the failures."""


class UrlGuardError(OSError):
    """A connection the guard refused (an ``OSError``, so urllib reports it as a ``URLError``)."""


def embedded_ipv4(ip: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address stands for (IPv4-mapped, 6to4, NAT64 well-known prefixes), if any."""
    if ip.version == 4:
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if any(ip in net for net in _NAT64):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def _kind(addr: IPAddress) -> str | None:
    for attr, kind in _KINDS:
        if getattr(addr, attr):
            return kind
    return None if addr.is_global else "non-global"


def address_kind(ip: IPAddress) -> str | None:
    """Why ``ip`` is not a public unicast address (``loopback``, ``private``, ...), or None when it is.

    An IPv4-mapped or NAT64 address is the IPv4 address it carries (that is where the packets go);
    a 6to4 address must be public both as itself and as its IPv4 address.
    """
    v4 = embedded_ipv4(ip)
    if v4 is not None and (ip.ipv4_mapped is not None or any(ip in net for net in _NAT64)):
        return _kind(v4)
    # the carried IPv4 address's kind first: older Python 3.11 releases (3.11.2) call all of 2002::/16 "private"
    return (_kind(v4) if v4 is not None else None) or _kind(ip)


@dataclass(frozen=True)
class GuardPolicy:
    """Which addresses may be fetched: public ones, plus those inside ``allow_networks`` (CIDRs)."""

    allow_networks: tuple[str, ...] = ()
    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        nets = tuple(ipaddress.ip_network(cidr, strict=False) for cidr in self.allow_networks)
        object.__setattr__(self, "networks", nets)

    def refusal(self, ip: IPAddress | str) -> str | None:
        """The kind of address (``loopback``, ...) when ``ip`` may not be fetched; None when it may."""
        ip = ipaddress.ip_address(ip) if isinstance(ip, str) else ip
        kind = address_kind(ip)
        if kind is None:
            return None
        v4 = embedded_ipv4(ip)
        if any(addr in net for addr in (ip, v4) if addr is not None for net in self.networks):
            return None
        return kind


def scheme_refusal(url: object) -> str | None:
    """The guard's error message when ``url`` is not an http(s) URL with a host; None when it is."""
    if not isinstance(url, str):
        return f"{REFUSED_SCHEME}: not a URL ({type(url).__name__})"
    try:
        parts = urlsplit(url.strip())
        scheme, host = parts.scheme.lower(), parts.hostname
    except ValueError as err:
        return f"{REFUSED_SCHEME}: unparsable URL ({err})"
    if not scheme:
        return f"{REFUSED_SCHEME}: none (only http and https URLs are fetched)"
    if scheme not in ALLOWED_SCHEMES:
        return f"{REFUSED_SCHEME} {scheme!r} (only http and https are fetched)"
    if not host:
        return f"{REFUSED_SCHEME}: {scheme} URL without a host"
    return None


def _address_order(ip: str) -> tuple[int, int]:
    """Sort key of an address: IPv4 before IPv6, then numerically."""
    addr = ipaddress.ip_address(ip)
    return addr.version, int(addr)


def guarded_create_connection(
    policy: GuardPolicy,
    address: tuple[str, int],
    timeout: Any = socket._GLOBAL_DEFAULT_TIMEOUT,  # socket.create_connection's default
    source_address: tuple[str, int] | None = None,
    **_: Any,
) -> socket.socket:
    """``socket.create_connection`` that resolves ``address`` once and connects only to allowed addresses.

    Raises :class:`UrlGuardError` when the host has no allowed address.
    """
    host, port = address
    allowed, refused = [], {}
    for family, type_, proto, _canon, sockaddr in socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM):
        ip = ipaddress.ip_address(sockaddr[0])
        kind = policy.refusal(ip)
        if kind is None:
            allowed.append((family, type_, proto, sockaddr))
        else:
            refused[str(ip)] = kind
    if not allowed:
        # sorted: the message must not depend on the order of the DNS answer (shard metadata is hashed)
        ordered = sorted(refused.items(), key=lambda item: _address_order(item[0]))
        why = ", ".join(f"{ip} ({kind})" for ip, kind in ordered) or "nothing"
        raise UrlGuardError(f"{REFUSED_ADDRESS} {host!r}: resolves to {why}, not in fetch.allow_networks")
    error: OSError | None = None
    for family, type_, proto, sockaddr in allowed:
        sock = socket.socket(family, type_, proto)
        try:
            if timeout is not socket._GLOBAL_DEFAULT_TIMEOUT:
                sock.settimeout(timeout)
            if source_address:
                sock.bind(source_address)
            sock.connect(sockaddr)
            return sock
        except OSError as err:
            sock.close()
            error = err
    assert error is not None
    raise error


class _GuardedHTTPConnection(http.client.HTTPConnection):
    def __init__(self, *args: Any, policy: GuardPolicy, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._create_connection = functools.partial(guarded_create_connection, policy)


class _GuardedHTTPSConnection(http.client.HTTPSConnection):
    def __init__(self, *args: Any, policy: GuardPolicy, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._create_connection = functools.partial(guarded_create_connection, policy)


class _GuardedHTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, policy: GuardPolicy) -> None:
        super().__init__()
        self.policy = policy

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(_GuardedHTTPConnection, policy=self.policy), req)


class _GuardedHTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, policy: GuardPolicy) -> None:
        super().__init__()
        self.policy = policy

    def do_open(self, http_class: Any, req: urllib.request.Request, **kwargs: Any) -> http.client.HTTPResponse:
        return super().do_open(functools.partial(_GuardedHTTPSConnection, policy=self.policy), req, **kwargs)


class _RefuseOtherSchemes(urllib.request.BaseHandler):
    """Answers every scheme the opener has no handler for (file, ftp, data, ...) with a refusal."""

    def unknown_open(self, req: urllib.request.Request) -> None:
        raise urllib.error.URLError(f"{REFUSED_SCHEME} {req.type!r} (only http and https are fetched)")


class _GuardedRedirects(urllib.request.HTTPRedirectHandler):
    """Redirects are followed only to http(s); the address check happens when the new hop connects."""

    def http_error_302(self, req, fp, code, msg, headers):
        target = headers.get("location") or headers.get("uri")
        if target is not None:
            refusal = scheme_refusal(urljoin(req.full_url, target))
            if refusal is not None:
                fp.close()
                raise urllib.error.URLError(f"{refusal} in a redirect from {req.full_url}")
        return super().http_error_302(req, fp, code, msg, headers)

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302


def build_opener(policy: GuardPolicy) -> urllib.request.OpenerDirector:
    """A urllib opener with only guarded HTTP(S), redirect and error handlers (no file/ftp/data, no proxy)."""
    opener = urllib.request.OpenerDirector()
    for handler in (
        _RefuseOtherSchemes(),
        _GuardedHTTPHandler(policy),
        _GuardedHTTPSHandler(policy),
        urllib.request.HTTPDefaultErrorHandler(),
        _GuardedRedirects(),
        urllib.request.HTTPErrorProcessor(),
    ):
        opener.add_handler(handler)
    return opener


_installed: GuardPolicy | None = None


def install(policy: GuardPolicy) -> None:
    """Install the guard in this process (idempotent): urllib's opener and the scheme check."""
    global _installed
    if _installed == policy:
        return
    # lazy: img2dataset pulls albumentations/wandb (~2 s); only URL sources patch it
    import img2dataset.downloader as i2d_downloader

    urllib.request.install_opener(build_opener(policy))
    original = getattr(i2d_downloader.download_image, "__wrapped__", i2d_downloader.download_image)

    @functools.wraps(original)
    def download_image(row, timeout, user_agent_token, disallowed_header_directives):
        key, url = row
        refusal = scheme_refusal(url)
        if refusal is not None:
            return key, None, refusal
        # a URL's credentials are never sent (the filter stores them redacted: ``http://***@host/``)
        row = key, without_userinfo(url)
        return original(row, timeout, user_agent_token, disallowed_header_directives)

    i2d_downloader.download_image = download_image
    _installed = policy


class GuardedDownloader(Downloader):
    """img2dataset's ``Downloader`` that installs the guard in the worker before fetching a shard.

    ``sample_resizer``, when given, replaces the ``resizer`` img2dataset built (same call and return values;
    the fetch stage's :class:`~sdforge.ingest.image_convert.SampleResizer`). ``after_shard(shard_id)``, when
    given (a picklable callable), runs in the worker after each shard that img2dataset finished (the fetch
    stage canonicalises the shard there, in parallel with the other workers' downloads); if it fails, the
    shard is left as img2dataset wrote it.
    """

    def __init__(
        self,
        *args: Any,
        guard: GuardPolicy,
        sample_resizer: Callable[..., tuple] | None = None,
        after_shard: Callable[[int], None] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.guard = guard
        if sample_resizer is not None:
            self.resizer = sample_resizer
        self.after_shard = after_shard

    def __call__(self, row: Any) -> Any:
        install(self.guard)
        ok, row = super().__call__(row)
        if ok and self.after_shard is not None:
            try:
                self.after_shard(row[0])
            except Exception as err:  # img2dataset's convention: a worker reports and goes on
                print(f"after_shard({row[0]}) failed in worker {os.getpid()}: {err!r}")
        return ok, row


@contextlib.contextmanager
def guarded_img2dataset(
    allow_networks: Iterable[str],
    sample_resizer: Callable[..., tuple] | None = None,
    after_shard: Callable[[int], None] | None = None,
) -> Iterator[GuardPolicy]:
    """Within the block, ``img2dataset.download`` fetches through :class:`GuardedDownloader` (with
    ``sample_resizer`` in place of img2dataset's own); restored on exit."""
    i2d_main = importlib.import_module("img2dataset.main")  # ``img2dataset.main`` the attribute is a function
    policy = GuardPolicy(tuple(allow_networks))
    saved_class = i2d_main.Downloader
    i2d_main.Downloader = functools.partial(
        GuardedDownloader, guard=policy, sample_resizer=sample_resizer, after_shard=after_shard
    )
    try:
        yield policy
    finally:
        i2d_main.Downloader = saved_class


_DECODE_FAILURES = ("not a readable image", "image decoding failed", "decoding failed")
"""How :func:`sdforge.ingest.image_convert.convert`'s messages for unreadable image bytes begin."""


def failure_reason(message: str | None) -> str:
    """The :data:`REASONS` key for a failed sample's ``error_message`` (img2dataset's or the guard's)."""
    m = message or ""
    if REFUSED_SCHEME in m:
        return "refused_scheme"
    if REFUSED_ADDRESS in m:
        return "refused_ssrf"
    if m.startswith("HTTP Error"):
        return "error_http"
    if "X-Robots-Tag" in m:
        return "error_robots"
    # the decode policy's messages (sdforge.ingest.image_convert), then img2dataset's own (shards it decoded)
    if "fetch.max_image_pixels" in m or "a side over JPEG" in m:
        return "error_too_many_pixels"
    if m in ("zero-byte file", "image has no pixels") or m.startswith(_DECODE_FAILURES):
        return "error_decode"
    if "CV_IO_MAX_IMAGE_" in m or m == "image area too large":
        return "error_too_many_pixels"
    if m == "Image decoding error" or "OpenCV(" in m:
        return "error_decode"
    network = ("<urlopen error", "timed out", "IncompleteRead", "Remote end closed", "Connection", "reset by peer")
    if any(s in m for s in network):
        return "error_network"
    return "error_other"
