"""Fuzzing the SDK's HTTP/1.1 response parsing (sdk/uds.py), against a unix-socket server that answers
every request with drawn bytes: well-formed responses mutated (status lines, lying Content-Length,
broken or huge chunk sizes, header floods, cut anywhere) and noise. A call returns a response whose body
reads to its end, or raises httpx's own errors (what the SDK maps to DaemonUnreachable and friends),
within its timeouts."""

from __future__ import annotations

import asyncio
import tempfile

import httpx
from hypothesis import given
from hypothesis import strategies as st

from dsec.sdk.uds import UnixTransport

from .budget import bounded_memory, fuzz, outcome

TIMEOUT = httpx.Timeout(0.1)
STATUS_LINES = st.sampled_from(
    [
        *(b"HTTP/1.1 200 OK", b"HTTP/1.1 404 Not Found", b"HTTP/1.0 200 OK", b"HTTP/1.1 100 Continue", b"HTTP/1.1 204"),
        *(b"HTTP/1.1 999 X", b"HTTP/2 200", b"HTTP/1.1 -1 X", b"http/1.1 200 ok", b"HTTP/1.1 200 OK\n", b""),
    ]
)
HEADERS = st.lists(
    st.sampled_from(
        [
            *(b"content-length: 5", b"content-length: 0", b"content-length: 99999999999", b"content-length: -1"),
            *(b"content-length: 5\r\ncontent-length: 6", b"transfer-encoding: chunked", b"transfer-encoding: gzip"),
            *(b"connection: close", b"connection: keep-alive", b"x: " + b"a" * 5000, b"bad header", b": x"),
            *(b"content-type: application/json", b"x:\x00\xff"),
        ]
    ),
    max_size=4,
)
BODIES = st.one_of(
    st.sampled_from([b"hello", b"", b"5\r\nhello\r\n0\r\n\r\n", b"ffffffffff\r\nx", b"zz\r\n", b"0\r\n\r\n"]),
    st.binary(max_size=40),
)


@st.composite
def responses(draw: st.DrawFn) -> bytes:
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=200))
    head = b"\r\n".join([draw(STATUS_LINES), *draw(HEADERS)]) + b"\r\n\r\n"
    data = head + draw(BODIES)
    cut = draw(st.one_of(st.none(), st.integers(0, len(data))))
    return data if cut is None else data[:cut]


async def _exchange(answers: list[bytes], keep_open: bool) -> None:
    pending = list(answers)

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while pending:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(pending.pop(0))
                await writer.drain()
                if not keep_open:
                    break
            await asyncio.sleep(0.2 if keep_open else 0)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        server = await asyncio.start_unix_server(on_conn, f"{d}/s.sock")
        transport = UnixTransport(f"{d}/s.sock")
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://dsec", timeout=TIMEOUT) as client:
                for _ in answers:
                    try:
                        reply = await asyncio.wait_for(client.get("/v1/health"), 5)
                        outcome(f"status {reply.status_code}")
                        assert len(reply.content) <= 200
                    except httpx.HTTPError as e:
                        outcome(type(e).__name__)
        finally:
            server.close()
            await server.wait_closed()


@fuzz(150)
@given(answers=st.lists(responses(), min_size=1, max_size=3), keep_open=st.booleans())
def test_any_response_is_read_or_an_httpx_error(answers: list[bytes], keep_open: bool) -> None:
    with bounded_memory():
        asyncio.run(_exchange(answers, keep_open))


FLOOD = 64 << 20  # bytes of response headers the server offers
HEADER_LIMIT = 1 << 20  # what a client may reasonably buffer before giving up


async def _flood() -> tuple[int, str]:
    sent = 0

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        await reader.readuntil(b"\r\n\r\n")
        lines = (b"x-flood: " + b"a" * 990 + b"\r\n") * 64
        try:
            writer.write(b"HTTP/1.1 200 OK\r\n")
            while sent < FLOOD:
                writer.write(lines)
                await writer.drain()
                sent += len(lines)
        except ConnectionError:
            pass
        finally:
            writer.close()

    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        server = await asyncio.start_unix_server(on_conn, f"{d}/s.sock")
        try:
            transport = UnixTransport(f"{d}/s.sock")
            async with httpx.AsyncClient(transport=transport, base_url="http://dsec", timeout=5) as client:
                try:
                    await client.get("/v1/health")
                    what = "a response"
                except httpx.HTTPError as e:
                    what = type(e).__name__
        finally:
            server.close()
            await server.wait_closed()
    return sent, what


def test_a_header_flood_is_refused_before_it_is_buffered() -> None:
    """sdk/uds.py buffered response headers without a bound (httptools sets none): a server that kept
    sending headers grew the client's memory for ever (22 GB in 2 minutes, measured)."""
    sent, what = asyncio.run(_flood())
    assert sent <= 2 * HEADER_LIMIT + (1 << 20), f"the client read {sent} bytes of headers ({what})"
    assert what == "RemoteProtocolError"
