"""The Connect protocol layer of the E2B-compatible envd API: envelopes, request checks, responses, and a run
against the real connectrpc client as the e2b SDK builds it."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import pytest
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from dsec.e2b.connect import (
    HTTP_STATUS,
    HttpError,
    RpcError,
    client_stream_response,
    codec_check,
    end_of_stream,
    envelope,
    error_response,
    method_check,
    read_messages,
    stream_error_response,
    stream_messages,
    stream_request_message,
    stream_response,
    timeout_ms,
    unary_message,
    unary_response,
)
from dsec.e2b.envd_models import (
    DataEvent,
    EndEvent,
    ListRequest,
    ListResponse,
    ProcessConfig,
    ProcessEvent,
    ProcessInfo,
    SendSignalRequest,
    StartEvent,
    StartRequest,
    StartResponse,
    StreamInputRequest,
    StreamInputResponse,
)

JSON = "application/json"
STREAM = "application/connect+json"

# -- helpers ---------------------------------------------------------------------------------------------------------


async def collect(chunks: Iterable[bytes], max_message: int = 1 << 20) -> list[bytes]:
    async def body() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk

    return [m async for m in read_messages(body(), max_message)]


def fails(call: Callable[..., object], *args: Any, **kwargs: Any) -> RpcError:
    with pytest.raises(RpcError) as caught:
        call(*args, **kwargs)
    return caught.value


async def afails(pending: Awaitable[object]) -> RpcError:
    with pytest.raises(RpcError) as caught:
        await pending
    return caught.value


def incoming(headers: dict[str, str] | None = None, body: bytes | list[bytes] = b"", method: str = "POST") -> Request:
    parts = [body] if isinstance(body, bytes) else body
    messages = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    raw = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    return Request({"type": "http", "method": method, "path": "/", "query_string": b"", "headers": raw}, receive)


def frames(body: bytes) -> list[tuple[int, bytes]]:
    out, pos = [], 0
    while pos < len(body):
        flags, length = struct.unpack_from(">BI", body, pos)
        out.append((flags, body[pos + 5 : pos + 5 + length]))
        pos += 5 + length
    return out


class Client:
    """The ASGI peer of a response: records what is sent; reports a disconnect after ``disconnect_after`` body
    chunks, or stops reading (send never returns) after ``stall_after``."""

    def __init__(self, *, disconnect_after: int | None = None, stall_after: int | None = None) -> None:
        self.sent: list[dict[str, Any]] = []
        self.gone = asyncio.Event()
        self.disconnect_after, self.stall_after = disconnect_after, stall_after

    status = property(lambda self: int(self.sent[0]["status"]))
    headers = property(lambda self: {k.decode(): v.decode() for k, v in self.sent[0]["headers"]})
    chunks = property(lambda self: [m["body"] for m in self.sent[1:] if m["body"]])
    body = property(lambda self: b"".join(self.chunks))

    async def receive(self) -> dict[str, Any]:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)
        if self.disconnect_after is not None and len(self.chunks) >= self.disconnect_after:
            self.gone.set()
        if self.stall_after is not None and len(self.chunks) > self.stall_after:
            self.gone.set()
            await asyncio.Event().wait()


async def run(response: Response, client: Client | None = None) -> Client:
    client = client or Client()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "method": "POST", "headers": []}
    await asyncio.wait_for(response(scope, client.receive, client.send), 2)
    return client


def event(pid: int) -> StartResponse:
    return StartResponse(event=ProcessEvent(start=StartEvent(pid=pid)))


def eos_error(code: str, message: str) -> tuple[int, bytes]:
    return (2, json.dumps({"error": {"code": code, "message": message}}, separators=(",", ":")).encode())


# -- errors and envelopes --------------------------------------------------------------------------------------------


def test_rpc_error_codes_and_statuses() -> None:
    assert RpcError("not_found", "no such process").http_status == 404
    assert RpcError("canceled", "x").http_status == 499
    assert RpcError("resource_exhausted", "x").to_json() == {"code": "resource_exhausted", "message": "x"}
    assert len(HTTP_STATUS) == 16
    with pytest.raises(ValueError, match="not a Connect error code"):
        RpcError("NOT_FOUND", "x")


async def test_envelopes() -> None:
    assert envelope(b"ab") == b"\x00\x00\x00\x00\x02ab"
    assert envelope(b"", end=True) == b"\x02\x00\x00\x00\x00"
    assert frames(end_of_stream()) == [(2, b"{}")]
    assert frames(end_of_stream(RpcError("not_found", "gone"))) == [eos_error("not_found", "gone")]
    payloads = [b'{"a":1}', b"", b"x" * 70000, b"3"]
    body = b"".join(envelope(p) for p in payloads)
    assert await collect([body]) == payloads
    # straddling chunks, down to one byte at a time
    assert await collect([body[i : i + 1] for i in range(len(body))]) == payloads
    assert await collect([body[:3], body[3:11], b"", body[11:]]) == payloads


async def test_reading_stays_linear() -> None:
    began = time.perf_counter()
    # compacting the buffer per message would copy ~75 GB here
    got = await collect([envelope(b"0123456789") * 100_000])
    assert len(got) == 100_000 and got[-1] == b"0123456789"
    big = envelope(b"y" * (8 << 20))
    assert await collect([big[i : i + 4096] for i in range(0, len(big), 4096)], 16 << 20) == [big[5:]]
    assert time.perf_counter() - began < 2


async def test_bad_envelopes() -> None:
    # only the prefix arrives: the declared megabyte is refused without waiting for it
    assert (await afails(collect([struct.pack(">BI", 0, 1 << 20)], 1000))).code == "resource_exhausted"
    for truncated in (b"\x00\x00", envelope(b"hello")[:-1], envelope(b"ok") + b"\x00\x00\x00"):
        err = await afails(collect([truncated]))
        assert err.code == "invalid_argument" and "middle of a message" in err.message
    for flags, code in ((0x01, "internal"), (0x02, "invalid_argument"), (0x80, "invalid_argument")):
        assert (await afails(collect([struct.pack(">BI", flags, 2) + b"{}"]))).code == code


# -- request checks --------------------------------------------------------------------------------------------------


def test_timeout_header() -> None:
    assert timeout_ms(incoming()) is None
    for value, ms in (("0", 0), ("15000", 15000), ("9999999999", 9999999999)):
        assert timeout_ms(incoming({"connect-timeout-ms": value})) == ms
    for bad in ("12345678901", "-5", "+5", " 5", "5_000", "1.5", "soon", ""):
        assert fails(timeout_ms, incoming({"connect-timeout-ms": bad})).code == "invalid_argument"


def test_codec_check() -> None:
    accepted = [(JSON, False), ("application/json; charset=utf-8", False), ("Application/JSON", False), (STREAM, True)]
    for content_type, streaming in accepted:
        codec_check(incoming({"content-type": content_type, "connect-protocol-version": "1"}), streaming=streaming)
        codec_check(incoming({"content-type": content_type, "content-encoding": "identity"}), streaming=streaming)
    # binary protobuf, or the other kind of RPC's content type: 415 and what is accepted
    unsupported = [("application/proto", False), ("application/connect+proto", True), (STREAM, False), (JSON, True)]
    for content_type, streaming in [*unsupported, ("", False)]:
        with pytest.raises(HttpError) as caught:
            codec_check(incoming({"content-type": content_type}), streaming=streaming)
        response = caught.value.response()
        assert response.status_code == 415 and response.headers["accept-post"] == (STREAM if streaming else JSON)


def test_protocol_version_compression_and_method() -> None:
    wrong_version = incoming({"content-type": JSON, "connect-protocol-version": "2"})
    assert fails(codec_check, wrong_version, streaming=False).code == "invalid_argument"
    gzipped = incoming({"content-type": STREAM, "connect-content-encoding": "gzip"})
    assert fails(codec_check, gzipped, streaming=True).code == "unimplemented"
    method_check(incoming())
    with pytest.raises(HttpError) as caught:
        method_check(incoming(method="GET"))
    assert caught.value.status == 405 and caught.value.response().headers["allow"] == "POST"


async def test_unary_message() -> None:
    body = [b'{"process":{"pid":', b"7}", b',"signal":"SIGNAL_SIGKILL"}']
    assert (await unary_message(incoming(body=body), SendSignalRequest, 1000)).process.pid == 7
    assert (await unary_message(incoming(), ListRequest, 1000)) == ListRequest()
    too_big = incoming(body=[b"{" + b" " * 600, b" " * 600 + b"}"])
    assert (await afails(unary_message(too_big, ListRequest, 1000))).code == "resource_exhausted"
    declared = incoming({"content-length": "5000"}, body=b"{}")
    assert (await afails(unary_message(declared, ListRequest, 1000))).code == "resource_exhausted"


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b'{"process": {"pid": "x"}}', ["process.pid", "integer"]),
        (b'{"process": {"pid": 1, "tag": "a"}}', ["at most one of pid, tag"]),
        (b'{"process": ', ["malformed JSON"]),
        (b"[1]", ["SendSignalRequest"]),
        (b'{"signal": true}', ["signal"]),
    ],
)
async def test_unary_parse_errors_are_invalid_argument(body: bytes, words: list[str]) -> None:
    err = await afails(unary_message(incoming(body=body), SendSignalRequest, 1000))
    assert err.code == "invalid_argument" and "\n" not in err.message
    assert all(word in err.message for word in words), err.message


async def test_stream_messages() -> None:
    data = StreamInputRequest.model_validate({"data": {"input": {"stdin": "aGk="}}}).to_wire()
    body = envelope(b'{"start":{"process":{"pid":3}}}') + envelope(data) + envelope(b'{"keepalive":{}}')
    got = [m async for m in stream_messages(incoming(body=[body[:7], body[7:]]), StreamInputRequest, 1000)]
    assert [m.which("event") for m in got] == ["start", "data", "keepalive"]
    assert got[0].start is not None and got[0].start.process.pid == 3
    assert got[1].data is not None and got[1].data.input.stdin == b"hi"
    with pytest.raises(RpcError, match="invalid StreamInputRequest"):
        [m async for m in stream_messages(incoming(body=envelope(b'{"start": 5}')), StreamInputRequest, 1000)]


async def test_stream_request_message() -> None:
    req = await stream_request_message(incoming(body=envelope(b'{"process":{"cmd":"ls"}}')), StartRequest, 100)
    assert req.process.cmd == "ls"
    for body in (b"", envelope(b"{}") * 2):
        err = await afails(stream_request_message(incoming(body=body), StartRequest, 100))
        assert err.code == "invalid_argument"


# -- responses -------------------------------------------------------------------------------------------------------


async def test_unary_and_error_responses() -> None:
    sent = await run(unary_response(ListResponse(processes=[ProcessInfo(pid=4, config=ProcessConfig(cmd="sh"))])))
    assert sent.status == 200 and sent.headers["content-type"] == JSON
    assert json.loads(sent.body) == {"processes": [{"config": {"cmd": "sh", "args": [], "envs": {}}, "pid": 4}]}
    sent = await run(error_response(RpcError("not_found", "process 4 not found")))
    assert sent.status == 404 and sent.headers["content-type"] == JSON
    assert json.loads(sent.body) == {"code": "not_found", "message": "process 4 not found"}


async def test_client_stream_and_stream_error_responses() -> None:
    sent = await run(client_stream_response(StreamInputResponse()))
    assert sent.status == 200 and sent.headers["content-type"] == STREAM
    assert frames(sent.body) == [(0, b"{}"), (2, b"{}")]
    sent = await run(stream_error_response(RpcError("invalid_argument", "bad")))
    assert sent.status == 200 and frames(sent.body) == [eos_error("invalid_argument", "bad")]


async def test_stream_response_ends_with_empty_end_of_stream() -> None:
    async def events() -> AsyncIterator[BaseModel]:
        yield event(1)
        yield StartResponse(event=ProcessEvent(data=DataEvent(stdout=b"out")))

    sent = await run(stream_response(events(), headers={"x-extra": "1"}))
    assert sent.status == 200 and sent.headers["content-type"] == STREAM and sent.headers["x-extra"] == "1"
    # one envelope per send: each reaches the client when produced
    assert [frames(c) for c in sent.chunks] == [
        [(0, b'{"event":{"start":{"pid":1}}}')],
        [(0, b'{"event":{"data":{"stdout":"b3V0"}}}')],
        [(2, b"{}")],
    ]


async def test_stream_response_rpc_errors() -> None:
    async def failing() -> AsyncIterator[BaseModel]:
        yield event(1)
        raise RpcError("not_found", "process gone")

    async def failing_at_once() -> AsyncIterator[BaseModel]:
        raise RpcError("permission_denied", "no")
        yield event(1)

    assert frames((await run(stream_response(failing()))).body)[-1] == eos_error("not_found", "process gone")
    sent = await run(stream_response(failing_at_once()))
    assert sent.status == 200 and frames(sent.body) == [eos_error("permission_denied", "no")]


async def test_stream_response_other_exception_is_internal(caplog: pytest.LogCaptureFixture) -> None:
    async def events() -> AsyncIterator[BaseModel]:
        yield event(1)
        raise KeyError("/secret/path")

    with caplog.at_level(logging.ERROR, logger="dsec.e2b"):
        sent = await run(stream_response(events()))
    flags, payload = frames(sent.body)[-1]
    error = json.loads(payload)["error"]
    assert flags == 2 and error["code"] == "internal"
    assert "KeyError" in error["message"] and "secret" not in error["message"] and "Traceback" not in error["message"]
    assert any(r.name == "dsec.e2b" and r.exc_info for r in caplog.records)


async def test_stream_response_deadline() -> None:
    closed = asyncio.Event()

    async def events() -> AsyncIterator[BaseModel]:
        try:
            yield event(1)
            await asyncio.sleep(10)
        finally:
            closed.set()

    sent = await run(stream_response(events(), timeout_ms=50))
    assert [f for f, _ in frames(sent.body)] == [0, 2]
    assert json.loads(frames(sent.body)[-1][1])["error"]["code"] == "deadline_exceeded"
    assert closed.is_set()


async def test_disconnect_while_producer_waits_closes_it() -> None:
    cleaned = asyncio.Event()

    async def events() -> AsyncIterator[BaseModel]:
        try:
            yield event(1)
            await asyncio.sleep(10)  # a process with nothing to say
            yield event(2)
        finally:
            cleaned.set()

    sent = await run(stream_response(events()), Client(disconnect_after=1))
    assert cleaned.is_set() and len(sent.chunks) == 1


async def test_disconnect_while_client_stalls_closes_producer() -> None:
    cleanup: list[str] = []

    async def events() -> AsyncIterator[BaseModel]:
        try:
            for pid in range(100):
                yield event(pid)
        finally:
            await asyncio.sleep(0)  # cleanup that awaits must still complete
            cleanup.append("done")

    # the second send never returns: the generator is left suspended at a yield when the disconnect comes
    await run(stream_response(events()), Client(stall_after=1))
    assert cleanup == ["done"]


# -- against the real connectrpc client, as the e2b SDK builds it --------------------------------------------------

MAX = 1 << 20
received_stdin: list[bytes] = []


async def _start(request: Request) -> Response:
    try:
        method_check(request)
        codec_check(request, streaming=True)
        deadline = timeout_ms(request)
        req = await stream_request_message(request, StartRequest, MAX)
    except HttpError as e:
        return e.response()
    except RpcError as e:
        return stream_error_response(e)
    command = " ".join([req.process.cmd, *req.process.args]).encode()

    async def events() -> AsyncIterator[BaseModel]:
        for e in (
            ProcessEvent(start=StartEvent(pid=42)),
            ProcessEvent(data=DataEvent(stdout=command)),
            ProcessEvent(data=DataEvent(stderr=b"\x00\xff" + req.process.envs["K"].encode())),
            ProcessEvent(end=EndEvent(exit_code=-1, exited=False, status="signal: killed")),
        ):
            yield StartResponse(event=e)

    return stream_response(events(), timeout_ms=deadline)


async def _connect(request: Request) -> Response:
    async def events() -> AsyncIterator[BaseModel]:
        raise RpcError("not_found", "process with pid 9 not found")
        yield StartResponse()

    return stream_response(events())


async def _unary(request: Request, handle: Callable[[Any], BaseModel], model: type[BaseModel]) -> Response:
    try:
        codec_check(request, streaming=False)
        return unary_response(handle(await unary_message(request, model, MAX)))
    except HttpError as e:
        return e.response()
    except RpcError as e:
        return error_response(e)


async def _list(request: Request) -> Response:
    processes = [ProcessInfo(pid=7, tag="t", config=ProcessConfig(cmd="sleep", args=["9"], envs={"A": "b"}, cwd="/"))]
    return await _unary(request, lambda req: ListResponse(processes=processes), ListRequest)


def _no_such_process(req: SendSignalRequest) -> BaseModel:
    raise RpcError("not_found", f"process with pid {req.process.pid} not found ({req.signal.name})")


async def _send_signal(request: Request) -> Response:
    return await _unary(request, _no_such_process, SendSignalRequest)


async def _stream_input(request: Request) -> Response:
    try:
        codec_check(request, streaming=True)
        async for message in stream_messages(request, StreamInputRequest, MAX):
            if message.data is not None and message.data.input.stdin is not None:
                received_stdin.append(message.data.input.stdin)
    except RpcError as e:
        return stream_error_response(e)
    return client_stream_response(StreamInputResponse())


async def test_interop_with_connectrpc_client() -> None:
    pytest.importorskip("connectrpc")
    pytest.importorskip("e2b")
    import uvicorn
    from connectrpc.code import Code
    from connectrpc.errors import ConnectError
    from e2b.connection_config import ConnectionConfig
    from e2b.envd.client_async import create_rpc_client
    from e2b.envd.process import process_connect
    from e2b.envd.process import process_pb as pb
    from protobuf import Oneof

    routes = {"Start": _start, "Connect": _connect, "List": _list, "SendSignal": _send_signal}
    routes["StreamInput"] = _stream_input
    app = Starlette(routes=[Route(f"/process.Process/{name}", fn, methods=["POST"]) for name, fn in routes.items()])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning", timeout_graceful_shutdown=1))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:  # noqa: ASYNC110 (uvicorn sets a flag, no event)
            await asyncio.sleep(0.01)
        client = create_rpc_client(process_connect.ProcessClient, base, ConnectionConfig(api_key="x", sandbox_url=base))

        start = pb.StartRequest(process=pb.ProcessConfig(cmd="echo", args=["hi"], envs={"K": "v"}), stdin=False)
        got = [r.event.event async for r in client.start(start, timeout_ms=5000)]
        assert [e.field for e in got] == ["start", "data", "data", "end"]
        assert got[0].value.pid == 42
        assert got[1].value.output == Oneof("stdout", b"echo hi")
        assert got[2].value.output == Oneof("stderr", b"\x00\xffv")
        assert (got[3].value.exit_code, got[3].value.exited, got[3].value.status) == (-1, False, "signal: killed")

        [info] = (await client.list(pb.ListRequest())).processes
        assert (info.pid, info.tag, info.config.cmd, list(info.config.args)) == (7, "t", "sleep", ["9"])
        assert (dict(info.config.envs), info.config.cwd) == ({"A": "b"}, "/")

        selector = pb.ProcessSelector(selector=Oneof("pid", 9))
        with pytest.raises(ConnectError) as caught:
            await client.send_signal(pb.SendSignalRequest(process=selector, signal=pb.Signal.SIGKILL))
        assert caught.value.code is Code.NOT_FOUND
        assert caught.value.message == "process with pid 9 not found (SIGNAL_SIGKILL)"

        # an error before the first message: HTTP 200 and the error in the end of the stream
        with pytest.raises(ConnectError) as caught:
            [r async for r in client.connect(pb.ConnectRequest(process=selector))]
        assert caught.value.code is Code.NOT_FOUND

        async def inputs() -> AsyncIterator[pb.StreamInputRequest]:
            yield pb.StreamInputRequest(event=Oneof("start", pb.StreamInputRequest.StartEvent(process=selector)))
            for data in (b"ab", b"\x00c"):
                stdin = pb.ProcessInput(input=Oneof("stdin", data))
                yield pb.StreamInputRequest(event=Oneof("data", pb.StreamInputRequest.DataEvent(input=stdin)))

        received_stdin.clear()
        assert isinstance(await client.stream_input(inputs()), pb.StreamInputResponse)
        assert received_stdin == [b"ab", b"\x00c"]
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 5)
