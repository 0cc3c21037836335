"""The SDK's and the CLI's side of named volumes: bodies checked before the round trip."""

from __future__ import annotations

import pytest

import dsec
from dsec.cli.volume import parse_volumes
from dsec.sdk.aio import AsyncClient
from dsec.sdk.creating import create_body


def body(volumes: dict[str, str | tuple[str, str]] | None) -> dict[str, object]:
    return create_body("img", "container", {}, 60.0, None, None, None, None, None, volumes)


def test_volumes_in_a_creation() -> None:
    assert "volumes" not in body(None) and "volumes" not in body({})
    assert body({"/d": "v", "/r": ("w", "ro")})["volumes"] == {"/d": "v", "/r": ["w", "ro"]}
    with pytest.raises(dsec.InvalidRequest, match="volumes"):
        body({"/proc/x": "v"})
    with pytest.raises(dsec.InvalidRequest, match="one is inside the other"):
        body({"/d": "v", "/d/e": "w"})


async def test_bad_volumes_are_refused_before_asking() -> None:
    client = AsyncClient(url="http://127.0.0.1:9", token="t")  # nothing listens: nothing may be sent
    try:
        with pytest.raises(dsec.InvalidRequest, match="invalid volume name"):
            await client.create_volume("No/Slash")
        with pytest.raises(dsec.InvalidRequest, match="16Mi to 16Ti"):
            await client.create_volume("v", size="1Ki")
    finally:
        await client.aclose()


def test_cli_volume_options() -> None:
    assert parse_volumes(["/d=v", "/r=w:ro", "/x=y:rw"]) == {"/d": "v", "/r": ("w", "ro"), "/x": ("y", "rw")}
    for bad in ("/d", "=v", "/d=", "/d=v:rx"):
        with pytest.raises(dsec.InvalidRequest, match="--volume"):
            parse_volumes([bad])
