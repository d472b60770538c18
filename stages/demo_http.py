"""A quiet loopback HTTP server for the demo corpus (img2dataset fetches its URLs from it).

Usage::

    with serve_directory("data/demo_source/http", port=18765) as base_url:
        ...  # GET {base_url}/images/x.jpg
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

log = logging.getLogger(__name__)

HOST = "127.0.0.1"


class QuietHandler(SimpleHTTPRequestHandler):
    """Serves files from one directory; request lines go to DEBUG logging, not stderr."""

    def log_message(self, format: str, *args: object) -> None:
        log.debug("%s %s", self.address_string(), format % args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


@contextlib.contextmanager
def serve_directory(root: str | Path, port: int, host: str = HOST) -> Iterator[str]:
    """Serve ``root`` on ``host:port`` in a background thread; yield the base URL; stop on exit.

    Raises ``FileNotFoundError`` when ``root`` is not a directory and ``OSError`` when the port
    is taken.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"demo HTTP root {root} is not a directory (run make_demo_data first)")
    handler = functools.partial(QuietHandler, directory=str(root))
    server = _Server((host, port), handler)
    thread = threading.Thread(target=server.serve_forever, name=f"demo-http-{port}", daemon=True)
    thread.start()
    base_url = f"http://{host}:{port}"
    log.info("serving %s at %s", root, base_url)
    try:
        yield base_url
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
        log.info("stopped demo HTTP server at %s", base_url)
