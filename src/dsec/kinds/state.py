"""A kind's own state in its sandbox's record (``rec.runtime``), read and written only through a typed
view: the keys are named in one place per kind, and the record stores them, so a restarted daemon finds
what a sandbox's later calls need. Nothing outside the kind looks inside."""

from __future__ import annotations

from typing import Any

from ..store.records import SandboxRecord


class KindState:
    """What every kind that runs processes keeps: their environment, working directory and default
    account, and the sandbox's network interface."""

    __slots__ = ("_d",)

    def __init__(self, rec: SandboxRecord) -> None:
        self._d: dict[str, Any] = rec.runtime

    def _int(self, key: str) -> int | None:
        value = self._d.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def _set(self, key: str, value: object) -> None:
        if value is None:
            self._d.pop(key, None)
        else:
            self._d[key] = value

    @property
    def env(self) -> dict[str, str]:
        """The environment every exec starts from (the image's and the sandbox's), changed in place."""
        env = self._d.get("env")
        if not isinstance(env, dict):
            env = self._d["env"] = {}
        return env

    @env.setter
    def env(self, value: dict[str, str]) -> None:
        self._d["env"] = value

    @property
    def cwd(self) -> str:
        return str(self._d.get("cwd") or "/")

    @cwd.setter
    def cwd(self, value: str) -> None:
        self._d["cwd"] = value

    @property
    def user(self) -> tuple[int, int] | None:
        """The image's account (uid, gid) every exec runs as by default; None: root."""
        value = self._d.get("user")
        return (int(value[0]), int(value[1])) if isinstance(value, list) and len(value) == 2 else None

    @user.setter
    def user(self, value: tuple[int, int] | None) -> None:
        self._set("user", list(value) if value is not None else None)

    @property
    def home_given(self) -> bool:
        """HOME was set by the image or the sandbox's env: an exec as another account keeps it."""
        return bool(self._d.get("home_given"))

    @home_given.setter
    def home_given(self, value: bool) -> None:
        self._set("home_given", value)

    def home_for(self, req_env: dict[str, str], home: str) -> dict[str, str]:
        """The environment an exec as another account (``home``: its passwd entry's) adds: its HOME, as
        ``docker exec -u`` gives, unless the image, the sandbox or the call set HOME."""
        return {} if self.home_given or "HOME" in req_env else {"HOME": home}

    @property
    def net_index(self) -> int | None:
        """The sandbox's slot on the node's network (its interface and addresses), once it has one."""
        return self._int("net_index")

    @property
    def net_gen(self) -> int | None:
        """The generation of its rules in force (a restarted daemon re-adopts exactly those)."""
        return self._int("net_gen")

    def joined(self, index: int | None, gen: int | None) -> None:
        self._set("net_index", index)
        self._set("net_gen", gen)

    def changed(self, gen: int) -> None:
        self._d["net_gen"] = gen
