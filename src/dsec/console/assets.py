"""The console's built files (``make console`` writes them to assets/ beside this module) and the headers
every /ui answer carries."""

from __future__ import annotations

import re
from pathlib import Path

from starlette.responses import Response

ASSETS = Path(__file__).parent / "assets"

# No inline script or style, nothing from another origin: whatever a sandbox printed, the page can only
# run the bundle it was served with.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; connect-src 'self'; "
    "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}
TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".map": "application/json",
    ".txt": "text/plain; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
    ".woff2": "font/woff2",
}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # the build writes a flat folder of plain names
NOT_BUILT = (
    "<!doctype html><title>dsec console</title><p>The console's files are not built in this installation: "
    "run <code>make console</code> in the dsec checkout (it needs node and npm), then reload.</p>"
)


def page(name: str, assets: Path = ASSETS) -> Response:
    """One built file (index.html for the page itself), or 404; 503 with the way out if nothing is built."""
    headers = dict(HEADERS)
    if not (assets / "index.html").is_file():
        return Response(NOT_BUILT, status_code=503, media_type=TYPES[".html"], headers=headers)
    path = assets / name
    suffix = Path(name).suffix
    if not _NAME.match(name) or suffix not in TYPES or not path.is_file():
        return Response("not found\n", status_code=404, media_type="text/plain", headers=headers)
    # the page is fetched anew each time (it names the bundle); the bundle may be cached but is revalidated
    headers["Cache-Control"] = "no-store" if name == "index.html" else "no-cache"
    return Response(path.read_bytes(), media_type=TYPES[suffix], headers=headers)
