"""A node told which registries it may pull from refuses the others at once, without a request."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from dsec.errors import Forbidden, ImageNotFound
from dsec.images.registry import RegistryOptions
from dsec.images.store import ImageStore


def _store(root: Path, allowed: tuple[str, ...]) -> ImageStore:
    return ImageStore(root, lazy=False, mount=False, registry=RegistryOptions(allowed=allowed))


async def test_a_registry_not_allowed_is_refused_without_asking(tmp_path: Path) -> None:
    store = _store(tmp_path, ("registry.example",))
    started = time.monotonic()
    with pytest.raises(Forbidden, match=r"does not pull from 127\.0\.0\.1:5000"):
        await store.resolve("127.0.0.1:5000/org/task:1")
    with pytest.raises(Forbidden, match=r"docker\.io"):
        await store.pull("docker.io/library/python:3.11")
    with pytest.raises(ImageNotFound, match="Docker Hub is not allowed"):
        await store.resolve("python:3.11")  # a short name the node has not: Docker Hub's, not allowed
    assert time.monotonic() - started < 2  # no connection was tried


def test_allowed_hosts_match_with_or_without_a_port() -> None:
    options = RegistryOptions(allowed=("registry.example", "127.0.0.1:5000"))
    assert options.allows("registry.example") and options.allows("registry.example:443")
    assert options.allows("127.0.0.1:5000") and not options.allows("127.0.0.1:5001")
    assert not options.allows("docker.io") and RegistryOptions().allows("docker.io")
