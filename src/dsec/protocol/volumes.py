"""Named volumes: their names, sizes and info, and how a sandbox asks to mount them.

A volume is a file system of a fixed size kept on the node, outliving the sandboxes that mount it. A
creation names its mounts as ``{"/data": "name"}`` (read-write) or ``{"/data": ["name", "ro"]}``.

Each rule is a check with a message that says what is wrong and the JSON Schema that states the same
rule, side by side (as in types.py), so the generated OpenAPI is true. Two rules the schema cannot
state are checked here alone: no mount path inside another, and no volume named twice.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema, field_validator

from ..errors import InvalidRequest
from .types import PATH_MAX, Size, int_range

# ---- names -------------------------------------------------------------------------------------------

# a file name on the node and a word on the command line: no '/', never '.' or '..'
VOLUME_NAME = r"^[a-z0-9][a-z0-9_.-]{0,62}$"
_NAME_RE = re.compile(VOLUME_NAME)
NAME_RULE = "1-63 characters of a-z, 0-9, '_', '.' and '-', starting with a letter or digit"


def check_volume_name(name: object) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise InvalidRequest(f"invalid volume name {str(name)[:80]!r}: {NAME_RULE}")
    return name


VOLUME_NAME_SCHEMA: dict[str, Any] = {
    "type": "string",
    "minLength": 1,
    "maxLength": 63,
    "pattern": VOLUME_NAME,
    "description": f"Volume name: {NAME_RULE}.",
}
VolumeName = Annotated[str, AfterValidator(check_volume_name), WithJsonSchema(VOLUME_NAME_SCHEMA)]

# ---- sizes -------------------------------------------------------------------------------------------

# ext4 with a journal needs a few MiB of its own; below this a volume would hold almost nothing
MIN_VOLUME_SIZE = 16 << 20
MAX_VOLUME_SIZE = 16 << 40
DEFAULT_VOLUME_SIZE = 1 << 30


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class VolumeCreate(_Strict):
    name: VolumeName
    size: Size = Field(
        DEFAULT_VOLUME_SIZE,
        json_schema_extra=int_range(MIN_VOLUME_SIZE, MAX_VOLUME_SIZE),
        description="Its quota in bytes (or '10Gi'; 16Mi to 16Ti): what it can hold, file system metadata "
        "included. Taken from the node's disk as it is written, not up front.",
    )

    @field_validator("size")
    @classmethod
    def _size_bounds(cls, v: int) -> int:
        if not MIN_VOLUME_SIZE <= v <= MAX_VOLUME_SIZE:
            raise ValueError(f"size must be 16Mi to 16Ti, not {v}")
        return v


Mode = Literal["ro", "rw"]


class VolumeUser(BaseModel):
    sandbox: str
    mode: Mode


class VolumeInfo(BaseModel):
    name: str
    size: int = Field(description="Its quota in bytes.")
    used: int = Field(description="Bytes the node's disk holds for it now (its file system's blocks written).")
    created_at: datetime
    owner: str | None = Field(default=None, description="The tenant that made it; none for the operator's (public).")
    users: list[VolumeUser] = Field(default_factory=list, description="Live sandboxes that mount it, and how.")


class VolumeList(BaseModel):
    volumes: list[VolumeInfo]


class MountedVolume(BaseModel):
    """One volume of a sandbox, as its info shows it."""

    path: str
    name: str
    mode: Mode


# ---- mounts a creation asks for ------------------------------------------------------------------------

MAX_VOLUMES = 16
# the kernel's and the platform's own mounts in every sandbox: a volume over them would hide them
RESERVED = ("/proc", "/sys", "/dev", "/.dsec")
# one component of a clean path: not empty, not '.' or '..', no NUL
_COMPONENT = r"(?:[^/\x00.][^/\x00]*|\.[^/\x00.][^/\x00]*|\.\.[^/\x00]+)"
MOUNT_PATH = rf"^(?:/{_COMPONENT})+$"
_MOUNT_RE = re.compile(MOUNT_PATH)
RESERVED_PATTERN = r"^/(?:proc|sys|dev|\.dsec)(?:/|$)"
PATH_RULE = "an absolute path without '.', '..', '//' or a trailing '/', not '/' and not under " + ", ".join(RESERVED)


def check_mount_path(path: str) -> str:
    if len(path) > PATH_MAX or not _MOUNT_RE.fullmatch(path):
        raise ValueError(f"volume mount path {path[:80]!r}: expected {PATH_RULE}")
    if re.match(RESERVED_PATTERN, path):
        raise ValueError(f"volume mount path {path[:80]!r} is under {path.split('/')[1]!r}, which the sandbox needs")
    return path


def mode_of(ref: str | tuple[str, Mode]) -> tuple[str, Mode]:
    """(name, mode) of one mount as asked for: a bare name mounts read-write."""
    return (ref, "rw") if isinstance(ref, str) else ref


def check_volumes(volumes: dict[str, str | tuple[str, Mode]]) -> dict[str, str | tuple[str, Mode]]:
    if len(volumes) > MAX_VOLUMES:
        raise ValueError(f"at most {MAX_VOLUMES} volumes per sandbox")
    names: set[str] = set()
    for path, ref in volumes.items():
        check_mount_path(path)
        name = mode_of(ref)[0]
        try:
            check_volume_name(name)
        except InvalidRequest as e:
            raise ValueError(e.message) from None
        if name in names:
            raise ValueError(f"volume {name!r} is mounted twice: mount it once")
        names.add(name)
    for outer in volumes:  # every pair: sorted neighbours miss /a and /a/b around /a-b
        for inner in volumes:
            if inner.startswith(outer + "/"):
                raise ValueError(f"volume mount paths {outer!r} and {inner!r}: one is inside the other")
    return volumes


VOLUMES_SCHEMA: dict[str, Any] = {
    "type": "object",
    "maxProperties": MAX_VOLUMES,
    "propertyNames": {
        "type": "string",
        "minLength": 2,
        "maxLength": PATH_MAX,
        "allOf": [{"pattern": MOUNT_PATH}, {"not": {"pattern": RESERVED_PATTERN}}],
    },
    "additionalProperties": {
        "anyOf": [
            VOLUME_NAME_SCHEMA,
            {
                "type": "array",
                "minItems": 2,
                "maxItems": 2,
                "prefixItems": [VOLUME_NAME_SCHEMA, {"type": "string", "enum": ["ro", "rw"]}],
            },
        ]
    },
}
Volumes = Annotated[dict[str, str | tuple[str, Mode]], AfterValidator(check_volumes), WithJsonSchema(VOLUMES_SCHEMA)]
VOLUMES_DOC = (
    "Named volumes to mount, by path in the sandbox: {'/data': 'name'} read-write, {'/data': ['name', 'ro']} "
    f"read-only. At most {MAX_VOLUMES}; each path {PATH_RULE}, none inside another. A volume is mounted "
    "read-write by one live sandbox at a time, read-only by any number. Container kind only."
)
