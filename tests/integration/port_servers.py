"""The port tests' servers started in sandboxes (http_echo.py: HTTP on 8000; ws_echo.py: WebSocket echo
on 8300), and a client's way to an E2B sandbox's port by the host ``get_host`` names."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).parent
TOKEN = "e2b-traffic-access-token"


def serve(box: Any) -> None:
    """The servers, started in an E2B sandbox (an ``e2b.Sandbox``)."""
    box.files.write("/srv/http_echo.py", (HERE / "http_echo.py").read_bytes())
    box.files.write("/srv/ws_echo.py", (HERE / "ws_echo.py").read_bytes())
    box.files.write("/srv/www/hi.txt", "hello from inside\n")
    # timeout=0: E2B's default of 60 s would end them with any other command
    box.commands.run("python3 /srv/http_echo.py 8000 /srv/www", background=True, timeout=0)
    box.commands.run("python3 /srv/ws_echo.py 8300", background=True, timeout=0)


def fetch(
    listener: str, host: str, path: str, token: str | None, method: str = "GET", patient: bool = True, **kw: object
) -> httpx.Response:
    """``http://{host}{path}`` as a client with wildcard DNS for the domain would send it: to the
    listener, with ``host`` as the Host header. ``patient``: a 502 is asked again for a while (a server
    just started in the sandbox may not listen yet)."""
    headers = {"host": host} | ({TOKEN: token} if token is not None else {})
    deadline = time.monotonic() + (60 if patient else 0)
    while True:
        reply = httpx.request(method, listener + path, headers=headers, timeout=60, **kw)  # type: ignore[arg-type]
        if reply.status_code != 502 or time.monotonic() > deadline:
            return reply
        time.sleep(0.2)
