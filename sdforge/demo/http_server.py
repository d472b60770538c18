"""A quiet loopback HTTP server for the demo corpus (img2dataset fetches its URLs from it).

Usage::

    with serve_directory("data/demo_source/http", port=18765) as base_url:
        ...  # GET {base_url}/images/x.jpg

The tests and ``bench.fetch_images`` use the same server with a few knobs: ``port=0`` picks a free
port (read it from the yielded URL), ``hits`` counts requests per path, ``delay`` slows every
response down, ``redirects`` and ``errors`` answer chosen paths with a 302 or an HTTP error, and an
IPv6 ``host`` (``"::1"``) serves on IPv6.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

HOST = "127.0.0.1"


class QuietHandler(SimpleHTTPRequestHandler):
    """Serves files from one directory; request lines go to DEBUG logging, not stderr.

    Class attributes set per server by :func:`serve_directory`: ``hits`` (a Counter of request
    paths, or None), ``delay`` (seconds before answering), ``redirects`` (path → Location, 302) and
    ``errors`` (path → HTTP status).
    """

    hits: collections.Counter[str] | None = None
    hits_lock = threading.Lock()
    delay: float = 0.0
    redirects: Mapping[str, str] = {}
    errors: Mapping[str, int] = {}

    def log_message(self, format: str, *args: object) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def send_head(self):
        path = urlsplit(self.path).path
        if self.hits is not None:
            with self.hits_lock:
                self.hits[path] += 1
        if self.delay:
            time.sleep(self.delay)
        if path in self.redirects:
            self.send_response(302)
            self.send_header("Location", self.redirects[path])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        if path in self.errors:
            self.send_error(self.errors[path])
            return None
        return super().send_head()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128


class _Server6(_Server):
    address_family = socket.AF_INET6


@contextlib.contextmanager
def serve_directory(
    root: str | Path,
    port: int,
    host: str = HOST,
    *,
    hits: collections.Counter[str] | None = None,
    delay: float = 0.0,
    redirects: Mapping[str, str] | None = None,
    errors: Mapping[str, int] | None = None,
) -> Iterator[str]:
    """Serve ``root`` on ``host:port`` in a background thread; yield the base URL; stop on exit.

    ``port=0`` picks a free port. ``hits`` (a ``collections.Counter``) is incremented with each
    request's path; ``delay`` seconds are slept before each answer; ``redirects`` maps a path to
    the ``Location`` of a 302; ``errors`` maps a path to an HTTP error status.

    Raises ``FileNotFoundError`` when ``root`` is not a directory and ``OSError`` when the port
    is taken.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"demo HTTP root {root} is not a directory (run make_demo_data first)")
    handler_class = type(
        "Handler",
        (QuietHandler,),
        {"hits": hits, "delay": delay, "redirects": dict(redirects or {}), "errors": dict(errors or {})},
    )
    handler = functools.partial(handler_class, directory=str(root))
    server = (_Server6 if ":" in host else _Server)((host, port), handler)
    port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, name=f"demo-http-{port}", daemon=True)
    thread.start()
    base_url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    log.info("serving %s at %s", root, base_url)
    try:
        yield base_url
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
        log.info("stopped demo HTTP server at %s", base_url)
