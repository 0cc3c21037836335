"""Constrained types the wire models share. Each is a check (with an error message that says what is
wrong) and the JSON Schema that states the same rule in the generated OpenAPI, side by side, so that a
request the schema allows is not refused for its shape (tests/integration/test_api_fuzz.py checks the
two agree against a live daemon).

Lengths are counted in characters, as JSON Schema counts them; where the kernel counts bytes (an
environment string), the bound in characters is chosen so that the bytes fit too.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field, WithJsonSchema

from ..units import parse_size

PATH_MAX = 4096  # Linux's PATH_MAX: the bound of every path on the wire
NO_NUL = r"^[^\x00]*$"
ABS_PATH = r"^/[^\x00]*$"
# one component of a path that is not '..' (it may be empty: 'a//b' and a trailing '/' are allowed)
_NOT_DOTDOT = r"(?:[^/\x00.][^/\x00]*|\.(?:[^/\x00.][^/\x00]*)?|\.\.[^/\x00]+)?"
ABS_PATH_NO_DOTDOT = rf"^/{_NOT_DOTDOT}(?:/{_NOT_DOTDOT})*$"
PATH_NO_DOTDOT = rf"^{_NOT_DOTDOT}(?:/{_NOT_DOTDOT})*$"

# An environment string NAME=VALUE must fit the kernel's MAX_ARG_STRLEN (128 KiB with its NUL) in
# UTF-8, at most 4 bytes a character: 256 + 32,000 characters do.
MAX_ENV_VARS = 1024
MAX_ENV_NAME = 256
MAX_ENV_VALUE = 32_000
MAX_LABELS = 64
MAX_LABEL_KEY = 128
MAX_LABEL_VALUE = 512
MAX_COMMAND = 1 << 20  # argv + env bytes, like the kernel's ARG_MAX order of magnitude


def on_type(json_type: str, **keywords: Any) -> Callable[[dict[str, Any]], None]:
    """For ``json_schema_extra``: keywords a validator enforces, set on the value's schema of that JSON
    type (of an optional, on that branch of its anyOf: beside the anyOf a generator overlooks them)."""

    def apply(schema: dict[str, Any]) -> None:
        for branch in schema.get("anyOf", [schema]):
            if branch.get("type") == json_type:
                branch.update(keywords)

    return apply


def int_range(low: int, high: int) -> Callable[[dict[str, Any]], None]:
    return on_type("integer", minimum=low, maximum=high)


def _string(max_length: int, pattern: str = NO_NUL, min_length: int = 0) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string", "maxLength": max_length, "pattern": pattern}
    if min_length:
        schema["minLength"] = min_length
    return schema


# ---- paths -------------------------------------------------------------------------------------------


def check_abs_path(path: str) -> str:
    if not path.startswith("/") or "\0" in path or len(path) > PATH_MAX:
        raise ValueError(f"{path[:80]!r} must be an absolute path (at most {PATH_MAX} characters, no NUL)")
    return path


def clean_abs(path: str, what: str = "path") -> str:
    """An absolute path without '..', normalised ('//' and '.' dropped); ValueError naming ``what``."""
    if not path.startswith("/") or "\0" in path or len(path) > PATH_MAX:
        raise ValueError(f"{what} {path[:80]!r} must be an absolute path")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ValueError(f"{what} {path[:80]!r} must not contain '..'")
    return "/" + "/".join(parts)


AbsPath = Annotated[str, AfterValidator(check_abs_path), WithJsonSchema(_string(PATH_MAX, ABS_PATH, 1))]
CleanAbsPath = Annotated[str, AfterValidator(clean_abs), WithJsonSchema(_string(PATH_MAX, ABS_PATH_NO_DOTDOT, 1))]


# ---- environment and labels --------------------------------------------------------------------------


def check_env(env: dict[str, str]) -> dict[str, str]:
    if len(env) > MAX_ENV_VARS:
        raise ValueError(f"at most {MAX_ENV_VARS} environment variables")
    for name, value in env.items():
        if not name or "=" in name or "\0" in name or "\0" in value:
            raise ValueError(f"invalid environment variable name or value: {name[:80]!r}")
        if len(name) > MAX_ENV_NAME or len(value) > MAX_ENV_VALUE:
            raise ValueError(
                f"environment variable {name[:80]!r}: names take at most {MAX_ENV_NAME} characters, "
                f"values {MAX_ENV_VALUE}"
            )
    return env


ENV_NAME_SCHEMA = _string(MAX_ENV_NAME, r"^[^=\x00]+$", 1)
ENV_SCHEMA = {
    "type": "object",
    "maxProperties": MAX_ENV_VARS,
    "propertyNames": ENV_NAME_SCHEMA,
    "additionalProperties": _string(MAX_ENV_VALUE),
}
Env = Annotated[dict[str, str], AfterValidator(check_env), WithJsonSchema(ENV_SCHEMA)]


def check_env_name(name: str) -> str:
    check_env({name: ""})
    return name


EnvName = Annotated[str, AfterValidator(check_env_name), WithJsonSchema(ENV_NAME_SCHEMA)]


def check_labels(labels: dict[str, str]) -> dict[str, str]:
    if len(labels) > MAX_LABELS:
        raise ValueError(f"at most {MAX_LABELS} labels")
    for key, value in labels.items():
        if not key or len(key) > MAX_LABEL_KEY or len(value) > MAX_LABEL_VALUE:
            raise ValueError(f"label {key[:80]!r} is empty or too long")
    return labels


LABELS_SCHEMA = {
    "type": "object",
    "maxProperties": MAX_LABELS,
    "propertyNames": {"type": "string", "minLength": 1, "maxLength": MAX_LABEL_KEY},
    "additionalProperties": {"type": "string", "maxLength": MAX_LABEL_VALUE},
}
Labels = Annotated[dict[str, str], AfterValidator(check_labels), WithJsonSchema(LABELS_SCHEMA)]


# ---- commands ----------------------------------------------------------------------------------------

# White space spelled out (what str.isspace() calls so), not \s: regex engines disagree on \s
BLANK = r"\t\n\x0b\x0c\r\x1c-\x1f \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_NOT_BLANK = re.compile(rf"[^\x00{BLANK}]")


def check_command(cmd: str | list[str]) -> str | list[str]:
    """A string for /bin/sh -c (not blank), or an argv whose first item names the program; no NUL.
    Their total size, with the environment, is the request's to check."""
    if isinstance(cmd, str):
        if "\0" in cmd:
            raise ValueError("cmd contains a NUL byte")
        if not _NOT_BLANK.search(cmd):
            raise ValueError("cmd is empty")
    else:
        if not cmd or not cmd[0]:
            raise ValueError("cmd argv is empty")
        if any("\0" in a for a in cmd):
            raise ValueError("cmd contains a NUL byte")
    return cmd


COMMAND_SCHEMA = {
    "anyOf": [
        _string(MAX_COMMAND, rf"^[^\x00]*[^\x00{BLANK}][^\x00]*$", 1),
        {
            "type": "array",
            "minItems": 1,
            "maxItems": MAX_COMMAND,
            "prefixItems": [_string(MAX_COMMAND, NO_NUL, 1)],
            "items": _string(MAX_COMMAND),
        },
    ]
}
Command = Annotated[str | list[str], AfterValidator(check_command), WithJsonSchema(COMMAND_SCHEMA)]


# A time as a query parameter: ISO 8601, or epoch seconds (up to 2e10, the year 2603: pydantic reads a
# larger number as milliseconds)
TIME_SCHEMA = {"anyOf": [{"type": "string", "format": "date-time"}, {"type": "number", "minimum": 0, "maximum": 2e10}]}

# a user in an image: name or uid, optionally :group or :gid (resolved against the image's own files)
USER_SPEC = r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,31})?$"


# ---- sizes -------------------------------------------------------------------------------------------


def _size(value: object) -> object:
    if value is None or isinstance(value, int | str):
        return None if value is None else parse_size(value)
    return value


# the bound before the parser: after it, pydantic states it as "ge", which JSON Schema does not know
Size = Annotated[int, Field(ge=0), BeforeValidator(_size)]
