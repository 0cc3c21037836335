"""The blocking SDK, generated from the async one.

Every coroutine of ``AsyncSandbox``, ``AsyncFiles`` and ``AsyncClient`` runs on one background event
loop thread; the generated classes only forward calls and wrap returned async objects in their sync
counterparts. There is no second implementation to keep in step.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

from . import aio

T = TypeVar("T")


class _LoopThread:
    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._loop.is_closed():
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="dsec-sdk-loop", daemon=True).start()
                self._loop = loop
            return self._loop

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        loop = self.loop()
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            coro.close()
            raise RuntimeError("the sync dsec API cannot be called from its own loop thread")
        return asyncio.run_coroutine_threadsafe(coro, loop).result()


_runner = _LoopThread()
_SYNC_OF: dict[type, type] = {}


def _wrap(value: Any) -> Any:
    cls = _SYNC_OF.get(type(value))
    if cls is not None:
        obj: Any = object.__new__(cls)
        obj._impl = value
        return obj
    if isinstance(value, list):
        items = [_wrap(v) for v in value]
        if type(value) is list:
            return items
        # a list with more to say (a fork's failures): the same type, its attributes kept
        same = list.__new__(type(value))
        same.extend(items)
        same.__dict__.update(vars(value))
        return same
    return value


def _unwrap(value: Any) -> Any:
    impl = getattr(value, "_impl", None)
    return impl if impl is not None and type(impl) in _SYNC_OF else value


def _sync_iter(agen: Any) -> Iterator[Any]:
    try:
        while True:
            try:
                item = _runner.run(agen.__anext__())
            except StopAsyncIteration:
                return
            yield _wrap(item)
    finally:
        _runner.run(agen.aclose())


def _method(fn: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        def gen(self: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
            return _sync_iter(fn(self._impl, *args, **{k: _unwrap(v) for k, v in kwargs.items()}))

        return gen

    @functools.wraps(fn)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return _wrap(_runner.run(fn(self._impl, *args, **{k: _unwrap(v) for k, v in kwargs.items()})))

    return method


def _classmethod(async_cls: type, fn: Callable[..., Any]) -> classmethod[Any, Any, Any]:
    @functools.wraps(fn)
    def method(cls: type, *args: Any, **kwargs: Any) -> Any:
        async def call() -> Any:
            return await fn(async_cls, *args, **{k: _unwrap(v) for k, v in kwargs.items()})

        return _wrap(_runner.run(call()))

    return classmethod(method)


def _classgen(async_cls: type, fn: Callable[..., Any]) -> classmethod[Any, Any, Any]:
    @functools.wraps(fn)
    def method(cls: type, *args: Any, **kwargs: Any) -> Iterator[Any]:
        return _sync_iter(fn(async_cls, *args, **{k: _unwrap(v) for k, v in kwargs.items()}))

    return classmethod(method)


def _property(name: str) -> property:
    return property(lambda self: _wrap(getattr(self._impl, name)))


def synchronize(async_cls: type, name: str, doc: str | None = None) -> type:
    """A blocking class with the public API of ``async_cls``."""
    namespace: dict[str, Any] = {"__doc__": doc or async_cls.__doc__, "__module__": "dsec"}
    members: dict[str, Any] = {}
    for base in reversed(async_cls.__mro__[:-1]):  # mixins first, the class's own last (overrides win)
        members.update(vars(base))
    for attr, value in members.items():
        if attr.startswith("_"):
            continue
        if isinstance(value, classmethod) and inspect.iscoroutinefunction(value.__func__):
            namespace[attr] = _classmethod(async_cls, value.__func__)
        elif isinstance(value, classmethod) and inspect.isasyncgenfunction(value.__func__):
            namespace[attr] = _classgen(async_cls, value.__func__)
        elif inspect.iscoroutinefunction(value) or inspect.isasyncgenfunction(value):
            namespace[attr] = _method(value)
        elif isinstance(value, property):
            namespace[attr] = _property(attr)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        async def make() -> Any:
            return async_cls(*args, **{k: _unwrap(v) for k, v in kwargs.items()})

        self._impl = _runner.run(make())

    namespace["__init__"] = __init__
    namespace["__getattr__"] = lambda self, attr: _wrap(getattr(self._impl, attr))
    namespace["__repr__"] = lambda self: repr(self._impl)
    if hasattr(async_cls, "__aenter__"):
        namespace["__enter__"] = lambda self: self
        namespace["__exit__"] = lambda self, *exc: _runner.run(self._impl.__aexit__(*exc))
    if hasattr(async_cls, "aclose"):
        namespace["close"] = lambda self: _runner.run(self._impl.aclose())
    cls = type(name, (), namespace)
    _SYNC_OF[async_cls] = cls
    return cls


# Typed as Any: the members are generated; tests check they mirror the async classes one to one.
Files: Any = synchronize(aio.AsyncFiles, "Files")
Client: Any = synchronize(aio.AsyncClient, "Client")
Sandbox: Any = synchronize(aio.AsyncSandbox, "Sandbox")


_default_client: Any = None
_default_lock = threading.Lock()


def run(*args: Any, client: Any = None, **kwargs: Any) -> Any:
    """``dsec.run(image, command, *, code=, language=, stdin=, files=, timeout=, ...)``: one command in a
    warm function sandbox, blocking; see ``AsyncClient.run``. ``client``: a ``dsec.Client`` (default:
    one shared client from ``DSEC_URL`` / ``DSEC_TOKEN``)."""
    global _default_client
    if client is None:
        with _default_lock:
            if _default_client is None:
                _default_client = Client()
            client = _default_client
    return client.run(*args, **kwargs)
