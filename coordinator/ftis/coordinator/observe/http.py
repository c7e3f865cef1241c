"""The coordinator's HTTP listener (``serve --http-listen``): ``/metrics`` and the status
page, on the standard library's threading HTTP server in a daemon thread.

Routes (GET and HEAD only; anything else is 404 or 405):

* ``/metrics``: Prometheus text exposition (:mod:`ftis.coordinator.observe.metrics`);
* ``/``: the status page (``?window=SECONDS``, default 6 h);
* ``/status.json``: the page's data as JSON (same contents, same window parameter);
* ``/static/...``: the page's script and style and the vendored uPlot (a fixed list);
* ``/healthz``: ``ok``.

Every response is read-only and carries no envelope, key, completion text or setting
that is not on the page; the page is built from bounded database reads and reused for
:data:`PAGE_CACHE_S` seconds, so many viewers cost the database one build.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.parse
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from ftis.coordinator.config import parse_host_port
from ftis.coordinator.observe import metrics as m
from ftis.coordinator.observe import status as page
from ftis.coordinator.reputation import ReputationConfig

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parent / "static"
#: Files served under /static/ (nothing else is).
STATIC_FILES = {
    "status.js": "text/javascript; charset=utf-8",
    "status.css": "text/css; charset=utf-8",
    "uplot/uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "uplot/uPlot.min.css": "text/css; charset=utf-8",
    "uplot/LICENSE": "text/plain; charset=utf-8",
}
#: Seconds a built status page is reused.
PAGE_CACHE_S = 2.0
_SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Content-Security-Policy": ("default-src 'none'; script-src 'self'; style-src 'self'; "
                                "img-src 'self' data:; connect-src 'self'; "
                                "base-uri 'none'; form-action 'none'"),
}


class HttpBindError(RuntimeError):
    """The HTTP listener's address cannot be bound."""


class StatusHttpServer:
    """``/metrics`` and the status page over ``state``.

    Args:
        address: ``HOST:PORT`` (port 0 = any free port).
        state: the coordinator's storage (read only).
        clock: unix-milliseconds clock.
        policy: the configured reputation policy (an admin-set one stored in the
            database takes precedence, as in the coordinator).
        registry: what ``/metrics`` serves (default: this process's metrics plus the
            database gauges, :func:`metrics.exposition_registry`).
    """

    def __init__(self, address: str, state: Any, clock: Callable[[], int],
                 policy: ReputationConfig, registry: Any = None) -> None:
        self.state = state
        self.clock = clock
        self.policy = policy
        self.registry = registry if registry is not None else m.exposition_registry(state, clock)
        self._host, port = parse_host_port(address)
        self._requested_port = port
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._cache_lock = threading.Lock()
        self._cache: dict[int, tuple[float, dict[str, Any], bytes]] = {}

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        """Bind and serve in a daemon thread. Raises HttpBindError."""
        handler = _make_handler(self)
        server_cls = _server_class(self._host)
        try:
            server = server_cls((self._host.strip("[]"), self._requested_port), handler)
        except OSError as exc:
            raise HttpBindError(
                f"cannot listen on {self._host}:{self._requested_port}: {exc}") from None
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={
            "poll_interval": 0.2}, name="ftis-http", daemon=True)
        self._thread.start()
        log.info("HTTP (status page, /metrics) on %s", self.address)

    def stop(self) -> None:
        """Stop serving (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    @property
    def port(self) -> int:
        return self._server.server_address[1] if self._server is not None else 0

    @property
    def address(self) -> str:
        return f"{self._host}:{self.port}"

    # -- content -----------------------------------------------------------------------
    def status(self, window_s: int) -> tuple[dict[str, Any], bytes]:
        """The page's data and HTML for ``window_s`` (cached :data:`PAGE_CACHE_S`)."""
        with self._cache_lock:
            hit = self._cache.get(window_s)
            now = time.monotonic()
            if hit is not None and now - hit[0] < PAGE_CACHE_S:
                return hit[1], hit[2]
            policy = page.policy_of(self.state, self.policy)
            data = page.build_status(self.state, policy, self.clock(), window_s)
            body = page.render_page(data).encode()
            self._cache = {window_s: (now, data, body)}
            return data, body

    def metrics(self) -> bytes:
        return m.render(self.registry)


def _server_class(host: str) -> type[ThreadingHTTPServer]:
    import socket

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        allow_reuse_address = True
        address_family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET

    return Server


def _make_handler(owner: StatusHttpServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "ftis-coordinator"
        sys_version = ""
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            log.debug("http %s " + format, self.client_address[0], *args)

        def _send(self, status: int, body: bytes, content_type: str,
                  cache: str = "no-store") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", cache)
            for k, v in _SECURITY_HEADERS.items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_HEAD(self) -> None:  # noqa: N802
            self.do_GET()

        def do_GET(self) -> None:  # noqa: N802
            url = urllib.parse.urlsplit(self.path)
            query = urllib.parse.parse_qs(url.query)
            try:
                if url.path == "/metrics":
                    from prometheus_client import CONTENT_TYPE_LATEST

                    self._send(200, owner.metrics(), CONTENT_TYPE_LATEST)
                elif url.path in ("/", "/index.html"):
                    _, body = owner.status(_window(query))
                    self._send(200, body, "text/html; charset=utf-8")
                elif url.path == "/status.json":
                    data, _ = owner.status(_window(query))
                    body = json.dumps(data, allow_nan=False).encode()
                    self._send(200, body, "application/json")
                elif url.path == "/healthz":
                    self._send(200, b"ok\n", "text/plain; charset=utf-8")
                elif url.path.startswith("/static/") and url.path[8:] in STATIC_FILES:
                    name = url.path[8:]
                    body = (STATIC_DIR / name).read_bytes()
                    self._send(200, body, STATIC_FILES[name], cache="max-age=300")
                else:
                    self._send(404, b"not found\n", "text/plain; charset=utf-8")
            except Exception:
                log.exception("HTTP %s failed", url.path)
                self._send(500, b"internal error\n", "text/plain; charset=utf-8")

        def _refuse(self) -> None:
            self.send_response(HTTPStatus.METHOD_NOT_ALLOWED)
            self.send_header("Allow", "GET, HEAD")
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse  # noqa: N815

    return Handler


def _window(query: dict[str, list[str]]) -> int:
    try:
        return int(float(query.get("window", [page.DEFAULT_WINDOW_S])[0]))
    except (TypeError, ValueError):
        return page.DEFAULT_WINDOW_S
