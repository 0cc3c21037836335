"""Which sandboxes a list answers (GET /v1/sandboxes's filters and pages), as one function over the wire
models, so a node and the gateway (which merges its nodes' lists) select alike."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, Field

from .sandbox import Kind, SandboxInfo, SandboxList, State

MAX_PAGE = 500


class SandboxQuery(BaseModel):
    state: State | None = Field(None, description="Only sandboxes in this state.")
    kind: Kind | None = Field(None, description="Only sandboxes of this kind.")
    image: str | None = Field(None, max_length=512, description="Only sandboxes of this image (as created).")
    owner: str | None = Field(None, max_length=64, description="Only this tenant's sandboxes (the operator's call).")
    limit: int | None = Field(
        None, ge=1, le=MAX_PAGE, description="A page of at most this many, newest first, with the total."
    )
    offset: int = Field(0, ge=0, le=10_000_000, description="Sandboxes skipped before the page (with limit).")

    @property
    def filters(self) -> bool:
        return any(v is not None for v in (self.state, self.kind, self.image, self.owner, self.limit))


def select(infos: Sequence[SandboxInfo], q: SandboxQuery) -> SandboxList:
    """``infos`` oldest first, as a node lists them; the answer as the query asks."""
    if not q.filters:
        return SandboxList(sandboxes=list(infos))
    chosen = [
        i
        for i in infos
        if (q.state is None or i.state == q.state)
        and (q.kind is None or i.kind == q.kind)
        and (q.image is None or i.image == q.image)
        and (q.owner is None or i.owner == q.owner)
    ]
    if q.limit is None:
        return SandboxList(sandboxes=chosen)
    newest_first = chosen[::-1]
    return SandboxList(sandboxes=newest_first[q.offset : q.offset + q.limit], total=len(chosen))
