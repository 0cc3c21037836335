"""``/execute``'s answer while the cell runs: its output lines as the cell writes them, then the rest
(displays, the value, the error, the count) when it is done, as E2B's server streams them. A client that
goes away (the package's timeout closes the connection) has the cell stopped (``abandon``)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Response
from starlette.types import Receive, Scope, Send

from ..errors import DsecError, SandboxGone
from ..protocol.code import CodeResult
from .code_interpreter_wire import execution_lines

NDJSON = b"application/x-ndjson"
Output = asyncio.Queue[tuple[str, str]]  # (stream, text) pieces of the cell's output, in order


def output_line(stream: str, text: str) -> bytes:
    return json.dumps({"type": stream, "text": text, "timestamp": time.time_ns()}).encode() + b"\n"


def failure_line(e: BaseException) -> bytes:
    """The call failed after the answer began (its status is sent): said as the cell's error."""
    message = e.message if isinstance(e, DsecError) else f"{type(e).__name__}: {e}"
    name = type(e).__name__
    return json.dumps({"type": "error", "name": name, "value": message, "traceback": ""}).encode() + b"\n"


async def disconnected(receive: Receive) -> None:
    """Returns when the client closes the connection (the body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class Dropped(Response):
    """The sandbox went away mid-cell: the answer is begun and never ended, so the connection drops, as it
    does through E2B's proxy when a sandbox dies; the package then finds the sandbox gone (``settled``
    waits for its record to say so) and says that it was killed while the request was in progress."""

    def __init__(self, settled: Callable[[], Awaitable[None]]) -> None:
        super().__init__(media_type="application/x-ndjson")
        self.settled = settled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.settled()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", NDJSON)]})


class CellStream(Response):
    def __init__(
        self,
        first: tuple[str, str],
        output: Output,
        run: asyncio.Task[CodeResult],
        abandon: Callable[[], Awaitable[None]],
        ended: Callable[[], Awaitable[None]],
    ) -> None:
        super().__init__(media_type="application/x-ndjson")
        self.first = first
        self.output = output
        self.run = run
        self.abandon = abandon
        self.ended = ended

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", NDJSON)]})
        await self._body(send, output_line(*self.first))
        left = asyncio.create_task(disconnected(receive))
        try:
            outcome = await self._follow(send, left)
        finally:
            left.cancel()
        if outcome == "left":
            await self.abandon()
        elif outcome == "done":
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        else:  # the sandbox is gone: the answer stays unfinished, as Dropped's
            await self.ended()

    async def _follow(self, send: Send, left: asyncio.Task[None]) -> str:
        """Output lines until the cell is done, then its outcome: "done"; "left" if the client left first;
        "gone" if the sandbox did."""
        while True:
            piece = asyncio.ensure_future(self.output.get())
            await asyncio.wait({piece, self.run, left}, return_when=asyncio.FIRST_COMPLETED)
            if piece.done():
                await self._body(send, output_line(*piece.result()))
                continue
            piece.cancel()
            if left.done():
                return "left"
            await asyncio.sleep(0)  # output handed over just before the end is queued by now
            while not self.output.empty():
                await self._body(send, output_line(*self.output.get_nowait()))
            error = self.run.exception()
            if isinstance(error, SandboxGone):
                return "gone"
            tail = failure_line(error) if error is not None else execution_lines(self.run.result(), True, True)
            await self._body(send, tail)
            return "done"

    @staticmethod
    async def _body(send: Send, data: bytes) -> None:
        message: dict[str, Any] = {"type": "http.response.body", "body": data, "more_body": True}
        await send(message)
