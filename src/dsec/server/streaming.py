"""Answers streamed as newline-delimited JSON events (an exec's output, a pull's progress): whatever the
work does, the stream ends with its last event or an error event, and a caller who goes away cancels it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from ..errors import DsecError, environment_error
from ..protocol.sandbox import ErrorBody

log = logging.getLogger("dsec.server")
E = TypeVar("E", bound=BaseModel)


def event_stream(
    work: Callable[[Callable[[E], None]], Awaitable[None]], failed: Callable[[ErrorBody], E], what: str
) -> StreamingResponse:
    """``work`` is given a function to send each event; if it fails, ``failed`` makes the error event."""
    queue: asyncio.Queue[E | None] = asyncio.Queue()

    async def run() -> None:
        try:
            await work(queue.put_nowait)
        except DsecError as e:
            queue.put_nowait(failed(ErrorBody(code=e.code, message=e.message, detail=e.detail)))
        except Exception as e:  # the stream must always end with a result or an error
            if (known := environment_error(e)) is not None:
                queue.put_nowait(failed(ErrorBody(code=known.code, message=known.message)))
                return
            log.exception("%s failed", what)
            queue.put_nowait(failed(ErrorBody(code="internal", message=f"internal error: {e}")))
        finally:
            queue.put_nowait(None)

    async def events() -> AsyncIterator[bytes]:
        task = asyncio.create_task(run())
        try:
            while (event := await queue.get()) is not None:
                yield event.model_dump_json(exclude_none=True).encode() + b"\n"
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    return StreamingResponse(events(), media_type="application/x-ndjson")
