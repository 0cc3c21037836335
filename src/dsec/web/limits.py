"""Request body limits, applied before any handler buffers a body in memory."""

from __future__ import annotations

import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import LimitExceeded
from .errors import error_response

MAX_JSON_BODY = 32 << 20  # create/exec bodies: stdin is capped at 16 MiB, commands at 1 MiB
MAX_UPLOAD_BODY = 256 << 20  # file and archive uploads
UPLOAD_SUFFIXES = ("/files", "/archive", "/build-contexts")


class BodyLimit:
    """Answers 413 for a declared length over the limit, and stops reading an undeclared body past it.
    ``streamed``: paths whose handlers write the body somewhere bounded as it arrives, never holding it
    in memory, and bound it themselves."""

    def __init__(self, app: ASGIApp, streamed: re.Pattern[str] | None = None) -> None:
        self.app = app
        self.streamed = streamed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        if scope["type"] != "http" or (self.streamed is not None and self.streamed.match(path)):
            await self.app(scope, receive, send)
            return
        limit = MAX_UPLOAD_BODY if path.endswith(UPLOAD_SUFFIXES) else MAX_JSON_BODY
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                response = error_response(
                    413, LimitExceeded.code, f"request body of {int(value)} bytes exceeds the {limit}-byte limit"
                )
                await response(scope, receive, send)
                return
        seen = 0
        exceeded = False

        async def counted() -> Message:
            # Past the limit the app is told the client went away, and its answer is replaced by ours:
            # an exception here would be turned into a vague 400 by the body parser.
            nonlocal seen, exceeded
            if exceeded:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    exceeded = True
                    return {"type": "http.disconnect"}
            return message

        async def guarded(message: Message) -> None:
            if not exceeded:
                await send(message)

        try:
            await self.app(scope, counted, guarded)
        except Exception:
            if not exceeded:
                raise
        if exceeded:
            response = error_response(413, LimitExceeded.code, f"request body exceeds the {limit}-byte limit")
            await response(scope, receive, send)
