"""Request bodies are bounded before anything buffers them."""

from __future__ import annotations

from collections.abc import Iterator

from dsec.protocol.types import MAX_COMMAND
from dsec.web.limits import MAX_JSON_BODY

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
