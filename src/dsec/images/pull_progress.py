"""How far a registry pull has got, for its caller's progress callback and for whoever waits on it.

A pull's layers are each reused (the repository already has the layer converted), converted by this pull,
or converted by another pull of the same layer that started first; in the last case both pulls share one
``LayerProgress``, so each sees the bytes of the one transfer. The callback gets a snapshot, never the live
object, so it may keep it.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

log = logging.getLogger("dsec.images")

__all__ = ["LayerPhase", "LayerProgress", "PullPhase", "PullProgress", "PullReporter"]

PullPhase = Literal["resolving", "layers", "publishing", "done", "failed"]
LayerPhase = Literal["reused", "queued", "fetching", "converting", "publishing", "done", "failed"]
_FINISHED: frozenset[LayerPhase] = frozenset({"reused", "done"})
MIN_INTERVAL = 0.1  # seconds between two byte-count reports to a callback; phase changes always report


@dataclass
class LayerProgress:
    digest: str  # the registry blob
    size: int  # its bytes on the wire
    phase: LayerPhase = "queued"
    fetched: int = 0
    shared: bool = False  # converted by another pull that asked first

    @property
    def finished(self) -> bool:
        return self.phase in _FINISHED


@dataclass
class PullProgress:
    reference: str
    phase: PullPhase = "resolving"
    layers: list[LayerProgress] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    @property
    def layers_total(self) -> int:
        return len(self.layers)

    @property
    def layers_done(self) -> int:
        return sum(1 for x in self.layers if x.finished)

    @property
    def layers_reused(self) -> int:
        return sum(1 for x in self.layers if x.phase == "reused")

    @property
    def bytes_total(self) -> int:
        """What this pull has to fetch: the layers not reused."""
        return sum(x.size for x in self.layers if x.phase != "reused")

    @property
    def bytes_fetched(self) -> int:
        return sum(x.fetched for x in self.layers if x.phase != "reused")

    def snapshot(self) -> PullProgress:
        return copy.deepcopy(self)

    def waiting_for(self) -> str:
        """One line saying what the pull is doing now (what a sandbox starting on the image waits for)."""
        if self.phase == "resolving":
            return f"pulling {self.reference}: resolving its manifest"
        if self.phase == "publishing":
            return f"pulling {self.reference}: publishing the image"
        if self.phase in ("done", "failed"):
            return f"pulling {self.reference}: {self.phase}"
        busy = [x for x in self.layers if not x.finished]
        doing = ", ".join(f"{x.digest[7:19]} {x.phase}{' (another pull)' if x.shared else ''}" for x in busy[:3])
        more = f" and {len(busy) - 3} more" if len(busy) > 3 else ""
        return (
            f"pulling {self.reference}: {self.layers_done}/{self.layers_total} layers ready "
            f"({self.layers_reused} reused), {_mb(self.bytes_fetched)} of {_mb(self.bytes_total)} fetched; "
            f"{doing}{more}"
        )


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


class PullReporter:
    """Calls a pull's progress callback: at every phase change, and as bytes arrive at most every
    MIN_INTERVAL seconds. A callback that raises is logged and called no more."""

    def __init__(self, progress: PullProgress, callback: Callable[[PullProgress], None] | None) -> None:
        self.progress = progress
        self.callback = callback
        self._last = 0.0

    def phase(self) -> None:
        self._call()

    def bytes(self) -> None:
        now = time.monotonic()
        if now - self._last >= MIN_INTERVAL:
            self._call()

    def _call(self) -> None:
        if self.callback is None:
            return
        self._last = time.monotonic()
        try:
            self.callback(self.progress.snapshot())
        except Exception:  # it may run inside a conversion other pulls share: it must not fail theirs
            log.exception("a pull's progress callback failed; no more progress is reported to it")
            self.callback = None
