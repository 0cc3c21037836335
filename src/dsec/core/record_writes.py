"""Writing sandbox records to the state database when its file system may be full.

A transition that starts something (creating, running, paused) is refused when it cannot be recorded:
the caller gets ``StorageFull`` and nothing changed. A transition that ends something (stopping and the
terminal states) is never held up by its record: killing sandboxes is how an operator frees a full
disk, and a sandbox torn down whose record still says ``running`` is what a crash leaves anyway, which
a restarted daemon's adoption already handles. Such records are kept here and written again on every
reaper pass until the database takes them.
"""

from __future__ import annotations

import logging

from ..errors import environment_error
from ..protocol.sandbox import TERMINAL_STATES, State
from ..store.records import SandboxRecord
from ..store.sqlite import SandboxStore

log = logging.getLogger("dsec.core")

# states whose record may be written later: they end a sandbox
DEFERRABLE = frozenset(TERMINAL_STATES | {State.stopping})


class RecordWrites:
    def __init__(self, store: SandboxStore) -> None:
        self.store = store
        self.unsaved: dict[str, SandboxRecord] = {}

    def write(self, rec: SandboxRecord) -> None:
        """Write ``rec``; raises ``StorageFull`` (and other database errors) unless its state is one whose
        write may wait."""
        try:
            self.store.put(rec)
        except Exception as e:
            full = environment_error(e)
            if full is None:
                raise
            if rec.state not in DEFERRABLE:
                raise full from e
            if rec.id not in self.unsaved:
                log.warning("sandbox %s is %s, not yet recorded: %s", rec.id, rec.state.value, full.message)
            self.unsaved[rec.id] = rec
            return
        self.unsaved.pop(rec.id, None)

    def flush(self) -> None:
        """Write what waits, oldest first, until the database refuses again."""
        for rec in list(self.unsaved.values()):
            try:
                self.store.put(rec)
            except Exception as e:
                if environment_error(e) is not None:
                    return
                log.exception("sandbox %s: its record cannot be written; given up", rec.id)
            else:
                log.info("sandbox %s: its %s state is recorded now", rec.id, rec.state.value)
            self.unsaved.pop(rec.id, None)
