"""Wire models of a sandbox's checkpoints: its state kept under a name, to roll back to in place."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

MAX_CHECKPOINTS = 16  # per sandbox: each holds a packed copy of the writable layer on the node's disk
CHECKPOINT_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
# a checkpoint is named by its id (c1, c2, ... in the order a sandbox took them) or by its name
CHECKPOINT_REF = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class CheckpointRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(
        None,
        pattern=CHECKPOINT_NAME,
        description="A name to roll back to it by, unique within the sandbox (1-64 of A-Z a-z 0-9 . _ -).",
    )
    processes: bool | None = Field(
        None,
        description="Keep processes and memory too: true asks for it (an error where the node cannot: GET "
        "/v1/node says, per kind), false for files only; default: what the kind can.",
    )


class CheckpointInfo(BaseModel):
    id: str = Field(
        description="c1, c2, ...: numbered in the order the sandbox took them, so a rebuild of its "
        "trajectory takes the same ids."
    )
    name: str | None = None
    sandbox_id: str
    created_at: float = Field(description="Unix time.")
    size: int = Field(ge=0, description="Bytes of the packed writable layer on the node's disk.")
    files: bool = Field(True, description="The writable layer is captured (always).")
    processes: bool = Field(False, description="Processes and memory are captured too.")
    seconds: float = Field(ge=0, description="How long taking it held the sandbox still.")


class CheckpointList(BaseModel):
    checkpoints: list[CheckpointInfo]


class RollbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    checkpoint: str = Field(pattern=CHECKPOINT_REF, description="The checkpoint's id or name.")


class CheckpointSupport(BaseModel):
    """What a checkpoint of a kind's sandbox captures on this node (GET /v1/node, ``checkpoints``)."""

    files: bool = Field(description="Its files (the writable layer): checkpoint, rollback and fork of files.")
    processes: bool = Field(description="Its processes and memory too.")
    why: str | None = Field(None, description="Why not everything is captured, where it is not.")
