"""An HTTP server in the standard library alone, run inside sandboxes by the port tests: it serves the
files of a directory, answers ``GET /headers`` with the request's headers (JSON: what the server was
told), ``GET /bytes?n=N`` with N bytes of a fixed pattern, ``GET /forever`` with an endless stream, and
a POST with its body's length and sha256, read to its end before answering (``POST /slow``: read at a
few tens of MB/s). The stock server answers a POST with 501 unread, and a close with unread input is a
reset that can destroy the answer on its way."""

import hashlib
import http.server
import json
import sys
import time
import urllib.parse
from collections.abc import Iterator


class Handler(http.server.SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _answer(self, body: bytes, kind: str = "text/plain") -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        if url.path == "/headers":
            self._answer(json.dumps([[k.lower(), v] for k, v in self.headers.items()]).encode(), "application/json")
        elif url.path == "/forever":
            self._forever()
        elif url.path == "/bytes":
            n = int(urllib.parse.parse_qs(url.query)["n"][0])
            self._answer((bytes(range(251)) * (n // 251 + 1))[:n], "application/octet-stream")
        else:
            super().do_GET()

    def _forever(self) -> None:
        """An endless event stream; when the client is gone (a write fails), a line in /tmp/forever.log."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            while True:
                self.wfile.write(b"5\r\ntick\n\r\n")
                self.wfile.flush()
                time.sleep(0.05)
        except OSError:
            self.close_connection = True
            with open("/tmp/forever.log", "a") as log:
                log.write("gone\n")

    def do_POST(self) -> None:
        slow = urllib.parse.urlsplit(self.path).path == "/slow"  # a reader slower than its client
        digest, size = hashlib.sha256(), 0
        for piece in self._body():
            digest.update(piece)
            size += len(piece)
            if slow:
                time.sleep(0.004)
        self._answer(f"{size} {digest.hexdigest()}".encode())

    def _body(self) -> Iterator[bytes]:
        if "chunked" in self.headers.get("Transfer-Encoding", ""):
            while size := int(self.rfile.readline().strip(), 16):
                yield self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
            return
        left = int(self.headers["Content-Length"])
        while left:
            piece = self.rfile.read(min(left, 1 << 18))
            left -= len(piece)
            yield piece


def main() -> None:
    port, root = int(sys.argv[1]), sys.argv[2]

    def handler(*args: object) -> Handler:
        return Handler(*args, directory=root)  # type: ignore[arg-type]

    http.server.ThreadingHTTPServer(("127.0.0.1", port), handler).serve_forever()


if __name__ == "__main__":
    main()
