"""Kinds are looked up by name and imported lazily, so the core never imports a concrete kind."""

from __future__ import annotations

import importlib

from ..errors import InvalidRequest
from .base import Backend, BackendContext

_KINDS: dict[str, str] = {
    "container": "dsec.kinds.container.backend:ContainerBackend",
    "function": "dsec.kinds.function.backend:FunctionBackend",
    "microvm": "dsec.kinds.microvm.backend:MicroVMBackend",
    "vm": "dsec.kinds.vm.backend:VMBackend",
}
_PLANNED: dict[str, str] = {}


def available() -> list[str]:
    return sorted(_KINDS)


def load(kind: str, ctx: BackendContext) -> Backend:
    target = _KINDS.get(kind)
    if target is None:
        if kind in _PLANNED:
            raise InvalidRequest(f"kind {kind!r} is not available in this version of dsec yet ({_PLANNED[kind]})")
        raise InvalidRequest(f"unknown kind {kind!r}; known kinds: {', '.join(available())}")
    module_name, _, cls_name = target.partition(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    backend: Backend = cls(ctx)
    return backend
