"""Serve one trace file once on 127.0.0.1 so that ui.perfetto.dev can open it by URL.

The UI fetches ``http://127.0.0.1:PORT/NAME`` from the browser: the server answers the
CORS preflight (including Chrome's private-network access), sends the file, and stops. The
UI's content security policy only allows port 9001 (the port `trace_processor --httpd` and
Perfetto's own ``open_trace_in_ui`` use), hence the default.

Only loopback clients can connect, and only requests addressed to 127.0.0.1 or localhost
are answered: a page that rebinds its own DNS name to 127.0.0.1 (DNS rebinding) sends its
own host name and gets 403. Each connection has a socket timeout, so an idle or trickling
client cannot hold the one-shot server past ``--timeout``.
"""

from __future__ import annotations

import http.server
import shutil
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path

from pipetrace.errors import PipetraceError

UI_ORIGIN = "https://ui.perfetto.dev"
DEFAULT_PORT = 9001
LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost"})
CONNECTION_TIMEOUT = 5.0
"""Seconds one connection may stay idle: a local browser sends its request at once."""


def ui_link(port: int, name: str, origin: str = UI_ORIGIN) -> str:
    return f"{origin}/#!/?url=http://127.0.0.1:{port}/{urllib.parse.quote(name)}"


def _host_name(header: str | None) -> str | None:
    """The host part of a Host header ("127.0.0.1:9001" -> "127.0.0.1"); None when absent."""
    if not header:
        return None
    return urllib.parse.urlsplit("//" + header).hostname


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _OneShotServer

    def setup(self) -> None:
        # Never wait on one connection longer than the server has left to live.
        self.timeout = max(0.05, min(CONNECTION_TIMEOUT, self.server.remaining()))
        super().setup()

    def _local_request(self) -> bool:
        if _host_name(self.headers.get("Host")) in LOCAL_HOSTS:
            return True
        self.send_error(403, "only requests for 127.0.0.1 or localhost are answered")
        return False

    def _cors(self) -> None:
        self.send_header("Access-Control-Allow-Origin", self.server.origin)
        self.send_header("Access-Control-Allow-Methods", "GET, HEAD, OPTIONS")
        self.send_header("Access-Control-Allow-Headers", "*")
        self.send_header("Access-Control-Allow-Private-Network", "true")
        self.send_header("Cache-Control", "no-cache")

    def do_OPTIONS(self) -> None:
        if not self._local_request():
            return
        self.send_response(204)
        self._cors()
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _file(self, body: bool) -> None:
        if not self._local_request():
            return
        wanted = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
        if wanted != "/" + self.server.path.name:
            self.send_error(404, "not the exported trace")
            return
        size = self.server.path.stat().st_size
        self.send_response(200)
        self._cors()
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(size))
        self.end_headers()
        if body:
            with open(self.server.path, "rb") as f:
                shutil.copyfileobj(f, self.wfile, 1 << 20)
            self.server.served = True

    def do_GET(self) -> None:
        self._file(body=True)

    def do_HEAD(self) -> None:
        self._file(body=False)

    def log_message(self, format: str, *args: object) -> None:  # quiet: the CLI says what matters
        pass


class _OneShotServer(http.server.HTTPServer):
    def __init__(self, path: Path, port: int, origin: str) -> None:
        self.path = path
        self.origin = origin
        self.served = False
        self.deadline = float("inf")
        super().__init__(("127.0.0.1", port), _Handler)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


def serve_once(
    path: str | Path,
    *,
    port: int = DEFAULT_PORT,
    timeout: float = 300.0,
    origin: str = UI_ORIGIN,
    ready: Callable[[str], None] | None = None,
) -> bool:
    """Serve ``path`` until it has been downloaded once, or ``timeout`` seconds passed.

    ``ready(link)`` is called once the server listens, with the UI link to open (port 0
    picks a free port, for tests). Returns True when the file was served. Ctrl-C raises
    KeyboardInterrupt after closing the socket.
    """
    path = Path(path)
    try:
        server = _OneShotServer(path, port, origin)
    except OSError as exc:
        raise PipetraceError(
            f"cannot serve on 127.0.0.1:{port} ({exc.strerror}); is another trace server running? "
            "Stop it, or pass --port (ui.perfetto.dev itself only fetches from port 9001)"
        ) from None
    with server:
        server.timeout = 0.25
        if ready is not None:
            ready(ui_link(server.server_address[1], path.name, origin))
        server.deadline = time.monotonic() + timeout
        while not server.served and server.remaining() > 0:
            server.handle_request()
    return server.served
