"""A container sandbox's own state in its record (see kinds/state.py)."""

from __future__ import annotations

from typing import Literal

from ..state import KindState

Init = Literal["agent", "agent-detached", "catatonit"]


class ContainerState(KindState):
    __slots__ = ()

    @property
    def init(self) -> Init:
        """What runs as the container's init: the sandbox agent (execs through it), the agent after a
        restart could not re-attach to it, or catatonit (execs through the runtime)."""
        value = self._d.get("init")
        return value if value in ("agent", "agent-detached") else "catatonit"

    @init.setter
    def init(self, value: Init) -> None:
        self._d["init"] = value

    @property
    def uid_base(self) -> int | None:
        """The first host uid of the sandbox's user namespace range; None: no user namespace."""
        return self._int("uid_base")

    @uid_base.setter
    def uid_base(self, value: int | None) -> None:
        self._set("uid_base", value)

    @property
    def worker(self) -> bool:
        """Created as a function worker (``ContainerBackend.create(..., worker=True)``): a scratch writable
        layer, no cgroup file system, its own /tmp, exec groups with names that tell nothing."""
        return self._d.get("worker") is True

    def mark_worker(self) -> None:
        self._d["worker"] = True

    def ready(self, group: str) -> None:
        """The next exec runs in ``group``, a cgroup already made (a worker's reset leaves one ready)."""
        self._d["ready_group"] = group

    def take_ready(self) -> str | None:
        value = self._d.pop("ready_group", None)
        return value if isinstance(value, str) else None
