"""A local image server on 127.0.0.1 for the http tests: one path per behaviour."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .images import GREEN, encode

GREEN_PNG = encode("PNG", size=(8, 6), color=GREEN)


class ImageServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.seen: list[tuple[str, str | None]] = []  # (path, Host header) of every request
        self.release = threading.Event()  # set at teardown: handlers that hold a request let go

    @property
    def port(self) -> int:
        return self.server_address[1]

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def paths(self) -> list[str]:
        return [path for path, _ in self.seen]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # the body ends when the connection closes
    server: ImageServer

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self.server.seen.append((self.path, self.headers.get("Host")))
        route = self.path.split("?", 1)[0].strip("/").replace("-", "_").replace(".", "_")
        getattr(self, f"route_{route}", self.route_missing)()

    def send(self, status: int, body: bytes = b"", **headers: str) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        self.send_header("Content-Length", headers.get("Content_Length", str(len(body))))
        self.end_headers()
        self.wfile.write(body)

    def route_green_png(self) -> None:
        self.send(200, GREEN_PNG, Content_Type="image/png")

    def route_text(self) -> None:
        self.send(200, b"hello, not an image", Content_Type="text/plain")

    def route_missing(self) -> None:
        self.send(404, b"not found")

    def route_gzip(self) -> None:
        self.send(200, GREEN_PNG, Content_Encoding="gzip")

    def route_hop(self) -> None:
        self.send(302, Location="/green.png")

    def route_away(self) -> None:  # to a host that is not on the list
        self.send(302, Location=self.server.url("/green.png", host="localhost"))

    def route_to_file(self) -> None:
        self.send(302, Location="file:///etc/passwd")

    def route_loop(self) -> None:
        self.send(301, Location="/loop")

    def route_declared_big(self) -> None:
        self.send(200, GREEN_PNG, Content_Length="1000000000")

    def route_endless(self) -> None:
        """No Content-Length, a body that never ends: only a client-side cap stops it."""
        self.send_response(200)
        self.end_headers()
        chunk = b"\x89PNG\r\n\x1a\n" + bytes(65528)
        try:
            while not self.server.release.is_set():
                self.wfile.write(chunk)
        except OSError:
            pass  # the client hung up

    def route_silent(self) -> None:
        """Reads the request, never answers (until teardown)."""
        self.server.release.wait(60)

    def route_drip(self) -> None:
        """Answers at once, then one byte at a time: each read is quick, the whole never finishes."""
        self.send_response(200)
        self.end_headers()
        try:
            while not self.server.release.wait(0.02):
                self.wfile.write(b"x")
                self.wfile.flush()
        except OSError:
            pass


def start() -> ImageServer:
    server = ImageServer()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def stop(server: ImageServer) -> None:
    server.release.set()
    server.shutdown()
    server.server_close()
