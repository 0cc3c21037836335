"""Transport failures become DsecErrors with a clear message, never a raw httpx traceback."""

from __future__ import annotations

import httpx
import pytest

from dsec.errors import DaemonUnreachable, SandboxTimeout
from dsec.sdk.transport import Transport


def transport_raising(exc: Exception) -> Transport:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc

    t = Transport(url="http://127.0.0.1:9", token="x")
    t.http = httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://dsec")
    return t


@pytest.mark.parametrize(
    "exc",
    [
        httpx.ReadError("connection reset"),
        httpx.RemoteProtocolError("server disconnected"),
        httpx.WriteError("broken pipe"),
    ],
)
async def test_broken_connection_is_daemon_unreachable(exc: Exception) -> None:
    t = transport_raising(exc)
    with pytest.raises(DaemonUnreachable, match="may or may not have taken effect"):
        await t.request("POST", "/v1/sandboxes/sb-1/exec", json={})
    await t.aclose()


async def test_refused_connection_says_how_to_fix() -> None:
    t = transport_raising(httpx.ConnectError("refused"))
    with pytest.raises(DaemonUnreachable, match="dsec serve"):
        await t.request("GET", "/v1/health")
    await t.aclose()


async def test_timeout_is_sandbox_timeout() -> None:
    t = transport_raising(httpx.ReadTimeout("slow"))
    with pytest.raises(SandboxTimeout):
        await t.request("GET", "/v1/health", timeout=1)
    await t.aclose()
