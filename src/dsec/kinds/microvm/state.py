"""A VM sandbox's own state in its record (see kinds/state.py); the vm kind keeps the same."""

from __future__ import annotations

from typing import Any

from ..state import KindState


class VMState(KindState):
    __slots__ = ()

    @property
    def pid(self) -> int | None:
        """QEMU's pid (checked against the sandbox's id before it is signalled: pids are reused)."""
        return self._int("pid")

    @pid.setter
    def pid(self, value: int) -> None:
        self._d["pid"] = value

    @property
    def shape(self) -> dict[str, Any] | None:
        """What the VM was started with (memory, cpus, layers): a copy of it must match."""
        value = self._d.get("spec")
        return value if isinstance(value, dict) else None

    @shape.setter
    def shape(self, value: dict[str, Any]) -> None:
        self._d["spec"] = value

    @property
    def user_spec(self) -> str:
        """The image's user, as the image names it."""
        return str(self._d.get("user_spec") or "")

    @user_spec.setter
    def user_spec(self, value: str) -> None:
        self._d["user_spec"] = value

    def boot_took(self, seconds: float) -> None:
        self._d["boot_s"] = round(seconds, 3)

    def inherit(self, parent: VMState) -> None:
        """A copy's: the parent's environment, directory and accounts (its processes came with it)."""
        self.env, self.cwd, self.user_spec, self.user = dict(parent.env), parent.cwd, parent.user_spec, parent.user
