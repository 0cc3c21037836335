"""A gateway over two fake nodes on loopback (test_gateway.py makes its own three)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from ...fakes.cluster import Harness, start


@pytest.fixture
async def cluster() -> AsyncIterator[Harness]:
    h = await start({"a": 8.0, "b": 8.0})
    try:
        yield h
    finally:
        await h.close()
