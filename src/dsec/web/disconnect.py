"""Work that only its caller wants: cancelled when the caller's connection goes away.

A creation waits for capacity in the admission queue for up to its ``queue_timeout``. A caller that gives
up first (its own timeout, Ctrl-C, a trainer preempted) used to leave the creation queued: admitted
later, it made a sandbox nobody knew the id of, which held its place until its time to live. Batches
already stop with their stream; single creations (dsec's, E2B's, and the gateway's, which then drops
its connection to the node, so the node cancels too) go through :func:`unless_gone`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Awaitable
from typing import Literal, TypeVar

from starlette.responses import Response
from starlette.types import Receive

log = logging.getLogger("dsec.server")

T = TypeVar("T")
# nginx's "client closed request": never read by the client, but what the audit log records
CLIENT_GONE = 499


class Gone(enum.Enum):
    GONE = "the client went away"


GONE = Gone.GONE


def gone_response() -> Response:
    return Response(status_code=CLIENT_GONE)


async def _disconnected(receive: Receive) -> None:
    """Returns when the client has disconnected. Only for a request whose body has been read: the next
    ASGI message is then the disconnect."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_gone(receive: Receive, work: Awaitable[T], what: str) -> T | Literal[Gone.GONE]:
    """``work``'s result, or, if the client disconnects first, ``work`` cancelled (its own cleanup runs:
    a queued creation leaves the queue, a half-made sandbox is destroyed) and ``GONE``."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watcher
    if task.done():  # done first, or in the same instant: its answer, which may still be delivered
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    log.info("%s: the client went away; cancelled", what)
    return GONE
