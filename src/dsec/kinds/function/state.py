"""A function sandbox's own state in its record (see kinds/state.py): the worker lent to it."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from ...protocol import network as policy
from ...protocol.sandbox import Limits, State
from ...store.records import SandboxRecord


class FunctionState:
    __slots__ = ("_d",)

    def __init__(self, rec: SandboxRecord) -> None:
        self._d: dict[str, Any] = rec.runtime

    def lent(self, worker: SandboxRecord, warm: bool, pool: tuple[Hashable, ...]) -> None:
        """The worker lent to the sandbox. Its state goes with the sandbox's record (the worker itself is
        never recorded), so a restarted daemon can find and release it; it is the worker's own dict, so
        what the worker's kind changes later is written with the sandbox too."""
        self._d["worker"] = {
            "id": worker.id,
            "runtime": worker.runtime,
            "network": policy.to_json(worker.network) if worker.network is not None else None,
            "warm": warm,
        }
        self._d["key"] = list(pool)

    @property
    def warm(self) -> bool:
        """Lent from the pool ready-made, rather than made for it."""
        info = self._d.get("worker")
        return isinstance(info, dict) and info.get("warm") is True

    @property
    def pool(self) -> tuple[Hashable, ...]:
        return tuple(self._d.get("key") or ())

    def adopted_worker(self, limits: Limits) -> SandboxRecord | None:
        """After a daemon restart: the lent worker's record, as the sandbox's record kept it."""
        info = self._d.get("worker")
        if not isinstance(info, dict) or not isinstance(info.get("id"), str):
            return None
        wrec = worker_record(info["id"], State.running, limits)
        wrec.restore(dict(info.get("runtime") or {}))  # (a daemon before typed records kept its network there)
        if info.get("network") is not None:
            wrec.network = policy.from_json(info["network"])
        return wrec


def worker_record(wid: str, state: State = State.stopping, limits: Limits | None = None) -> SandboxRecord:
    """A worker's container record made from its id alone (to adopt or to remove what a daemon left)."""
    return SandboxRecord(
        id=wid, kind="container", image="", state=state, created_at=0, expires_at=0, limits=limits or Limits()
    )
