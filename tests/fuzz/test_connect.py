"""Fuzzing the Connect codec of the E2B-compatible API (e2b/connect.py, e2b/envd_models.py): envelopes,
request headers and proto3-JSON messages. Whatever the client sends, the codec yields well-formed
messages or raises RpcError (a Connect error for the client) or HttpError (a bare HTTP status), never
another exception; a message it accepts survives a round trip through its own JSON."""

from __future__ import annotations

import asyncio
import inspect
import itertools
import json
import struct
from collections.abc import AsyncIterator
from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st
from pydantic.alias_generators import to_camel
from starlette.requests import Request

from dsec.e2b import envd_models
from dsec.e2b.connect import (
    HTTP_STATUS,
    HttpError,
    RpcError,
    codec_check,
    envelope,
    method_check,
    parse_message,
    read_messages,
    timeout_ms,
    unary_message,
)
from dsec.e2b.envd_models import WireModel

from .budget import bounded_memory, fuzz, outcome

MODELS: list[type[WireModel]] = sorted(
    (
        cls
        for _, cls in inspect.getmembers(envd_models, inspect.isclass)
        if issubclass(cls, WireModel) and cls is not WireModel
    ),
    key=lambda cls: cls.__name__,
)
FIELDS = sorted(
    {name for cls in MODELS for name in cls.model_fields} | {to_camel(n) for c in MODELS for n in c.model_fields}
)
# values that probe the proto3-JSON scalar rules: int64 as text, exponents, base64 variants, enum names,
# RFC 3339 corner cases
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
    st.sampled_from([10, 4300, 4301, 5000]).map(lambda n: "9" * n),  # int() refuses over 4300 digits
    st.sampled_from(
        [
            *("1e3", "1.5", "-0", "1e999999999", "1e-999999999", "0x10", " 5", "AAEC", "AA-_", "A", "===="),
            *("SIGNAL_SIGKILL", "FILE_TYPE_FILE", "15", "2024-02-30T00:00:00Z", "0001-01-01T00:00:00+01:00"),
            *("9999-12-31T23:59:59-01:00", "2024-01-01T00:00:00.123456789Z", "2024-01-01T00:00:00+99:00"),
        ]
    ),
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.sampled_from(FIELDS), st.text(max_size=8)), inner, max_size=5),
    ),
    max_leaves=20,
)
MESSAGES = st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=6)


def _dumps(value: Any) -> bytes:
    return json.dumps(value, allow_nan=False).encode()


@fuzz(1500)
@given(
    model=st.sampled_from(MODELS), body=st.one_of(MESSAGES.map(_dumps), st.binary(max_size=64), JSON_VALUES.map(_dumps))
)
@example(model=envd_models.EntryInfo, body=b'{"modifiedTime": "2024-01-01T00:00:00+99:00"}')
@example(model=envd_models.StartRequest, body=b'{"process": {"envs": {"a": null}}}')
def test_a_message_parses_and_round_trips_or_is_invalid_argument(model: type[WireModel], body: bytes) -> None:
    try:
        message = parse_message(model, body)
    except RpcError as e:
        assert e.code == "invalid_argument"
        outcome("refused")
        return
    outcome("parsed")
    again = parse_message(model, message.to_wire())
    assert again == message, (message.to_wire(), again.to_wire())
    json.loads(message.to_wire())  # the wire form is plain JSON


async def _read_all(chunks: list[bytes], max_message: int) -> list[bytes]:
    async def body() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk

    return [payload async for payload in read_messages(body(), max_message)]


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    return [*(data[a:b] for a, b in itertools.pairwise(points)), b""]


@fuzz(600)
@given(body=st.binary(max_size=200), cuts=st.lists(st.integers(0, 1 << 16), max_size=6), max_message=st.integers(0, 64))
@example(body=struct.pack(">BI", 0, 2**32 - 1), cuts=[], max_message=1 << 20)
def test_any_body_yields_bounded_messages_or_an_rpc_error(body: bytes, cuts: list[int], max_message: int) -> None:
    try:
        with bounded_memory():
            payloads = asyncio.run(_read_all(_split(body, cuts), max_message))
    except RpcError as e:
        assert e.code in HTTP_STATUS
        outcome(f"refused: {e.code}")
        return
    outcome(f"{min(len(payloads), 3)} messages")
    assert all(len(p) <= max_message for p in payloads)
    assert sum(5 + len(p) for p in payloads) == len(body)


@fuzz(300)
@given(payloads=st.lists(st.binary(max_size=40), max_size=5), cuts=st.lists(st.integers(0, 1 << 16), max_size=8))
def test_enveloped_messages_come_back_whole_however_the_body_is_cut(payloads: list[bytes], cuts: list[int]) -> None:
    body = b"".join(envelope(p) for p in payloads)
    assert asyncio.run(_read_all(_split(body, cuts), 40)) == payloads


HEADER_NAMES = st.sampled_from(
    [
        *("content-type", "connect-protocol-version", "connect-content-encoding", "content-encoding"),
        *("connect-timeout-ms", "content-length"),
    ]
)
HEADER_VALUES = st.one_of(
    st.sampled_from(["application/json", "application/connect+json", "application/JSON; charset=utf-8", "1", "2"]),
    st.sampled_from(["identity", "gzip", "", " 5", "+5", "5_000", "²", "99999999999", "0", "1" * 11]),
    st.binary(max_size=12).map(lambda b: b.decode("latin-1")),
)


def _request(headers: list[tuple[str, str]], body: list[bytes], method: str) -> Request:
    raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]
    chunks = list(body)

    async def receive() -> dict[str, Any]:
        chunk = chunks.pop(0) if chunks else b""
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    scope = {"type": "http", "method": method, "path": "/", "query_string": b"", "headers": raw}
    return Request(scope, receive)


@fuzz(800)
@given(
    headers=st.lists(st.tuples(HEADER_NAMES, HEADER_VALUES), max_size=5),
    body=st.lists(st.binary(max_size=40), max_size=3),
    method=st.sampled_from(["POST"] * 8 + ["GET", "PUT"]),
    streaming=st.booleans(),
)
def test_request_headers_and_unary_bodies_are_accepted_or_refused(
    headers: list[tuple[str, str]], body: list[bytes], method: str, streaming: bool
) -> None:
    kind = "application/connect+json" if streaming else "application/json"
    request = _request([("content-type", kind), *headers], body, method)  # later headers override it

    async def handle() -> None:
        method_check(request)
        codec_check(request, streaming=streaming)
        deadline = timeout_ms(request)
        assert deadline is None or 0 <= deadline < 10**10
        await unary_message(request, envd_models.StartRequest, 64)

    try:
        asyncio.run(handle())
    except HttpError as e:
        assert e.status in (405, 415)
        outcome(f"http {e.status}")
    except RpcError as e:
        assert e.code in HTTP_STATUS
        outcome(f"rpc {e.code}")
    else:
        outcome("accepted")
