"""The wire models of E2B's template build API (``Template.build``, tags, aliases), with E2B's JSON names.

Requests ignore fields this layer does not know (newer SDKs add some), as the control API's do.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints

from .control_models import _In, _Out

# a template's name: lower-case letters, digits, '.', '_' and '-' (one path part of an image name, so that
# no name can be mistaken for a registry's); a tag: Docker's rule for tags
NAME = r"^[a-z0-9][a-z0-9._-]{0,62}$"
TAG = r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$"
DEFAULT_TAG = "default"  # E2B's tag for a build named without one
MAX_TAGS = 32
MAX_STEPS = 1000
MAX_ARG = 1 << 20  # a step's argument (a command): the exec path's bound for commands
STEP_TYPES = ("RUN", "COPY", "WORKDIR", "USER", "ENV")
HASH = r"^[0-9a-f]{64}$"
Status = Literal["waiting", "building", "ready", "error"]
Level = Literal["debug", "info", "warn", "error"]


class NewTemplate(_In):
    """``POST /v3/templates``: a template (made the first time its name is used) and a new build of it."""

    name: Annotated[str, StringConstraints(max_length=200)] | None = None
    alias: Annotated[str, StringConstraints(max_length=200)] | None = None  # deprecated: the name
    tags: list[Annotated[str, StringConstraints(max_length=200)]] | None = Field(None, max_length=MAX_TAGS)
    cpu_count: int | None = Field(None, alias="cpuCount", ge=1, le=64)
    memory_mb: int | None = Field(None, alias="memoryMB", ge=128, le=1 << 20)


class TemplateRequested(_Out):
    template_id: str = Field(alias="templateID")
    build_id: str = Field(alias="buildID")
    public: bool = False
    names: list[str]
    tags: list[str]
    aliases: list[str]


class FileUpload(_Out):
    """``GET /templates/{id}/files/{hash}``: whether the build already has these files, else where to PUT them."""

    present: bool
    url: str | None = None


class Step(_In):
    type: Literal["RUN", "COPY", "WORKDIR", "USER", "ENV"]
    args: list[Annotated[str, StringConstraints(max_length=MAX_ARG)]] = Field(default_factory=list, max_length=256)
    files_hash: Annotated[str, StringConstraints(pattern=HASH)] | None = Field(None, alias="filesHash")
    force: bool | None = False


class BuildStart(_In):
    """``POST /v2/templates/{id}/builds/{build}``: what the build is made of."""

    from_image: Annotated[str, StringConstraints(max_length=512)] | None = Field(None, alias="fromImage")
    from_template: Annotated[str, StringConstraints(max_length=512)] | None = Field(None, alias="fromTemplate")
    from_image_registry: dict[str, Any] | None = Field(None, alias="fromImageRegistry")
    force: bool | None = False
    steps: list[Step] = Field(default_factory=list, max_length=MAX_STEPS)
    start_cmd: Annotated[str, StringConstraints(max_length=MAX_ARG)] | None = Field(None, alias="startCmd")
    ready_cmd: Annotated[str, StringConstraints(max_length=MAX_ARG)] | None = Field(None, alias="readyCmd")


class LogEntry(_Out):
    timestamp: datetime
    message: str
    level: Level = "info"
    step: str | None = None


class StatusReason(_Out):
    message: str
    step: str | None = None
    log_entries: list[LogEntry] | None = Field(None, alias="logEntries")


class BuildInfo(_Out):
    logs: list[str] = Field(default_factory=list)  # E2B's old plain logs: always empty, as E2B's are now
    log_entries: list[LogEntry] = Field(alias="logEntries")
    template_id: str = Field(alias="templateID")
    build_id: str = Field(alias="buildID")
    status: Status
    reason: StatusReason | None = None


class AliasFound(_Out):
    template_id: str = Field(alias="templateID")
    public: bool


class AssignTags(_In):
    target: Annotated[str, StringConstraints(min_length=1, max_length=300)]
    tags: list[Annotated[str, StringConstraints(max_length=300)]] = Field(min_length=1, max_length=MAX_TAGS)


class AssignedTags(_Out):
    tags: list[str]
    build_id: str = Field(alias="buildID")


class RemoveTags(_In):
    name: Annotated[str, StringConstraints(min_length=1, max_length=300)]
    tags: list[Annotated[str, StringConstraints(max_length=300)]] = Field(min_length=1, max_length=MAX_TAGS)


class TagInfo(_Out):
    tag: str
    build_id: str = Field(alias="buildID")
    created_at: datetime = Field(alias="createdAt")
