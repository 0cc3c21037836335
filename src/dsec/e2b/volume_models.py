"""The wire models of E2B's volume content API (``/volumecontent/{volumeID}/...``), with E2B's JSON
names: an entry's stat, the metadata a PATCH sets, and the API's error (whose ``code`` is a string,
unlike the control API's)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ..core.volume_files import MAX_ID, VolumeEntry


class _Out(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    def wire(self) -> bytes:
        return self.model_dump_json(by_alias=True, exclude_none=True).encode()


class VolumeEntryStat(_Out):
    name: str
    type: Literal["file", "directory", "symlink", "unknown"]
    path: str
    size: int
    mode: int = Field(..., description="Permission bits, with the set-id and sticky bits.")
    uid: int
    gid: int
    atime: datetime
    mtime: datetime
    ctime: datetime
    target: str | None = Field(None, description="A symlink's target, as it is written (never followed).")

    @classmethod
    def of(cls, e: VolumeEntry) -> VolumeEntryStat:
        def when(t: float) -> datetime:
            return datetime.fromtimestamp(t, UTC)

        return cls(
            name=e.name,
            type=e.type,
            path=e.path,
            size=e.size,
            mode=e.mode,
            uid=e.uid,
            gid=e.gid,
            atime=when(e.atime),
            mtime=when(e.mtime),
            ctime=when(e.ctime),
            target=e.target,
        )


class MetadataUpdate(BaseModel):
    """PATCH /volumecontent/{volumeID}/path: what to change (what is absent stays)."""

    model_config = ConfigDict(extra="ignore")

    uid: int | None = Field(None, ge=0, le=MAX_ID)
    gid: int | None = Field(None, ge=0, le=MAX_ID)
    mode: int | None = Field(None, ge=0, le=0o7777)


class ContentError(_Out):
    code: str = Field(..., description="dsec's error code (volume_in_use, file_not_found, ...).")
    message: str
