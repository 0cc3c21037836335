"""The sync API's stub is generated from the async classes and must be current."""

from __future__ import annotations

import inspect

import dsec
from dsec.sdk import aio, stubgen, sync


def test_stub_is_current() -> None:
    assert stubgen.STUB.read_text() == stubgen.render(), "run: python -m dsec.sdk.stubgen"


def test_stub_names_every_public_member() -> None:
    text = stubgen.render()
    for async_name, sync_name in stubgen.CLASSES:
        cls = getattr(aio, async_name)
        for name, member in vars(cls).items():
            if name.startswith("_"):
                continue
            if inspect.iscoroutinefunction(member) or isinstance(member, classmethod | property):
                assert f"def {name}(" in text, (sync_name, name)
    assert dsec.Sandbox is sync.Sandbox
