"""Request bodies are bounded before anything buffers them."""

from __future__ import annotations

import re
from collections.abc import Iterator

from starlette.types import Message, Receive, Scope, Send

from dsec.protocol.types import MAX_COMMAND
from dsec.web.limits import MAX_JSON_BODY, BodyLimit

from ..conftest import AUTH, Api


def test_declared_oversized_json_body_is_413(api: Api) -> None:
    headers = {**AUTH, "content-type": "application/json", "content-length": str(MAX_JSON_BODY + 1)}
    reply = api.client.post("/v1/sandboxes", headers=headers, content=b"{}")
    assert reply.status_code == 413
    assert reply.json()["error"]["code"] == "limit_exceeded"


def test_undeclared_oversized_body_is_cut_off(api: Api) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"image": "'
        for _ in range(MAX_JSON_BODY // (1 << 20) + 2):
            yield b"x" * (1 << 20)
        yield b'"}'

    reply = api.client.post("/v1/sandboxes", headers={**AUTH, "content-type": "application/json"}, content=chunks())
    assert reply.status_code == 413
    assert reply.json()["error"]["code"] == "limit_exceeded"


def test_command_over_the_size_limit_is_invalid(api: Api) -> None:
    sid = api.create()["id"]
    reply = api.client.post(f"/v1/sandboxes/{sid}/exec", headers=AUTH, json={"cmd": "x" * (MAX_COMMAND + 1)})
    assert reply.status_code == 400
    assert "limit" in reply.json()["error"]["message"]


async def test_streamed_paths_are_left_to_their_handlers() -> None:
    """A path the app streams to a bounded place (a volume's file) takes a body past the JSON limit; the
    others of the same app do not."""
    seen: dict[str, int] = {}

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        total = 0
        while True:
            message = await receive()
            total += len(message.get("body", b""))
            if not message.get("more_body") or message["type"] == "http.disconnect":
                break
        seen[scope["path"]] = total
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    limited = BodyLimit(app, streamed=re.compile(r"^/volumecontent/[^/]+/file$"))
    size = MAX_JSON_BODY + (1 << 20)
    for path, status in (("/volumecontent/v/file", 201), ("/volumecontent/v/path", 413)):
        sent = await _put(limited, path, size)
        assert sent[0]["status"] == status, path
    assert seen["/volumecontent/v/file"] == size


async def _put(app: BodyLimit, path: str, size: int) -> list[Message]:
    """What ``app`` sends for a PUT of ``size`` bytes to ``path``, in 1 MiB parts."""
    parts: list[Message] = [{"type": "http.request", "body": b"x" * (1 << 20), "more_body": True}] * (size >> 20)
    messages = iter([*parts, {"type": "http.request", "body": b"", "more_body": False}])
    sent: list[Message] = []

    async def receive() -> Message:
        return next(messages)

    async def send(message: Message) -> None:
        sent.append(message)

    await app({"type": "http", "method": "PUT", "path": path, "headers": []}, receive, send)
    return sent
