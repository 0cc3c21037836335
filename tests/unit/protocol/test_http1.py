"""The HTTP/1.1 answer parser both clients share (protocol/http1.py), against a real socket server that
answers with fixed bytes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from dsec.protocol.http1 import MAX_HEAD, Answer, Connection, ReadFailed


async def _serve(reply: bytes, *, hold: bool = False) -> AsyncIterator[Connection]:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(reply)
        await writer.drain()
        if hold:
            await asyncio.sleep(5)
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    conn = Connection(reader, writer)
    try:
        yield conn
    finally:
        conn.close()
        server.close()


async def _read(reply: bytes, *, lower: bool = False, timeout: float = 5, hold: bool = False) -> Answer:
    async for conn in _serve(reply, hold=hold):
        answer = Answer(lower=lower)
        while not answer.complete:
            await answer.feed(conn, timeout)
        return answer
    raise AssertionError("unreachable")


async def test_a_whole_answer_with_its_headers_body_and_keep_alive() -> None:
    a = await _read(b"HTTP/1.1 201 Created\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n\r\nhello", lower=True)
    assert (a.status, a.headers, b"".join(a.body), a.keep_alive) == (
        201,
        [(b"content-type", b"text/plain"), (b"content-length", b"5")],
        b"hello",
        True,
    )
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
    a = await _read(chunked)
    assert a.headers[0][0] == b"Transfer-Encoding" and b"".join(a.body) == b"abc" and not a.keep_alive


@pytest.mark.parametrize(
    ("reply", "why"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "closed"),  # cut off
        (b"NOT HTTP AT ALL\r\n\r\n", "malformed"),
        (b"HTTP/1.1 200 OK\r\n" + b"x-pad: " + b"y" * (MAX_HEAD + (1 << 16)) + b"\r\n\r\n", "head"),
    ],
)
async def test_a_bad_answer_fails_with_why(reply: bytes, why: str) -> None:
    with pytest.raises(ReadFailed) as e:
        await _read(reply)
    assert e.value.why == why


async def test_a_silent_server_times_out() -> None:
    with pytest.raises(ReadFailed) as e:
        await _read(b"HTTP/1.1 200 OK\r\n", timeout=0.2, hold=True)
    assert e.value.why == "timeout"


def test_an_idle_connection_expires() -> None:
    class _Reader:
        def at_eof(self) -> bool:
            return False

    class _Writer:
        def is_closing(self) -> bool:
            return False

    conn = Connection(_Reader(), _Writer())  # type: ignore[arg-type]
    assert conn.usable(30.0)
    conn.idle_since -= 31
    assert not conn.usable(30.0)
