"""Wire models of the grading path: ``POST /v1/sandboxes/{id}/grade`` (see core/grading.py)."""

from __future__ import annotations

import base64
import binascii
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .names import ImageName
from .sandbox import DEFAULT_OUTPUT_CAP, MAX_EXEC_TIMEOUT_S, MAX_OUTPUT_CAP, ExecResult, _Strict
from .types import MAX_COMMAND, PATH_MAX, CleanAbsPath, Command, clean_abs

GRADE_DIR = "/grade"
MAX_GRADE_FILES = 1000
MAX_GRADE_FILE = 8 << 20
MAX_GRADE_TOTAL = 16 << 20
MAX_GRADE_PATHS = 64
# What a grader executes or configures its interpreter from never comes from the candidate.
GRADE_REFUSED_DIRS: tuple[str, ...] = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/usr", "/etc")
GRADE_REFUSED_DIRS += ("/proc", "/sys", "/dev", "/run", "/boot", "/.dsec", GRADE_DIR)


MAX_FILE_CONTENT = (MAX_GRADE_FILE + 2) // 3 * 4  # the longest content of a file within the limit (base64)
BASE64 = r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"
# a test file's name: a path relative to /grade (or under it), each part a name (not '.' or '..')
_PART = r"(?:[^/\x00.][^/\x00]*|\.[^/\x00.][^/\x00]*|\.\.[^/\x00]+)"
TEST_FILE = rf"^(?:{GRADE_DIR}/)?{_PART}(?:/{_PART})*$"
MAX_TEST_FILE_NAME = PATH_MAX - 1  # '/' + name is a path


class GradeFile(_Strict):
    model_config = ConfigDict(
        json_schema_extra={
            "if": {"properties": {"encoding": {"const": "base64"}}, "required": ["encoding"]},
            "then": {"properties": {"content": {"pattern": BASE64}}},
        }
    )

    content: str = Field(
        max_length=MAX_FILE_CONTENT, description="The file's text, or its bytes in base64 (padded, no white space)."
    )
    encoding: Literal["text", "base64"] = "text"

    def data(self) -> bytes:
        if self.encoding == "text":
            return self.content.encode()
        try:
            return base64.b64decode(self.content, validate=True)
        except binascii.Error as e:
            raise ValueError(f"invalid base64: {e}") from None


class GradeRequest(_Strict):
    """Run ``cmd`` against a read-only copy of the candidate's ``paths`` in a fresh sibling sandbox of its
    pristine image, with pristine ``tests`` under /grade, as uid 65534, with a fixed environment."""

    cmd: Command = Field(..., description="A string is run by the pristine image's /bin/sh -c; a list is the argv.")
    tests: dict[str, str | GradeFile] = Field(
        default_factory=dict,
        json_schema_extra={
            "maxProperties": MAX_GRADE_FILES,
            "propertyNames": {"minLength": 1, "maxLength": MAX_TEST_FILE_NAME, "pattern": TEST_FILE},
        },
        description=f"Files placed read-only under /grade: path (relative to /grade) -> content (at most "
        f"{MAX_GRADE_FILE} bytes each, {MAX_GRADE_TOTAL} in all).",
    )
    paths: list[CleanAbsPath] = Field(
        ...,
        min_length=1,
        max_length=MAX_GRADE_PATHS,
        description="The candidate's directories or files to copy (not / nor a system or platform directory: "
        + ", ".join(GRADE_REFUSED_DIRS)
        + ").",
    )
    timeout: float = Field(600.0, gt=0, le=MAX_EXEC_TIMEOUT_S, description="Seconds the command may run.")
    output_limit: int = Field(DEFAULT_OUTPUT_CAP, ge=1024, le=MAX_OUTPUT_CAP, description="Bytes kept per stream.")
    cwd: CleanAbsPath = Field(GRADE_DIR, description="Working directory of the command (absolute).")
    image: ImageName | None = Field(
        None, description="Image to grade on; default: the exact version the candidate was created from."
    )

    @field_validator("cmd")
    @classmethod
    def _cmd(cls, v: str | list[str]) -> str | list[str]:
        if sum(len(p.encode()) + 1 for p in ([v] if isinstance(v, str) else v)) > MAX_COMMAND:
            raise ValueError(f"cmd is over the {MAX_COMMAND}-byte limit")
        return v

    @field_validator("paths")
    @classmethod
    def _paths(cls, v: list[str]) -> list[str]:
        out = []
        for path in v:
            if path == "/" or any(path == d or path.startswith(d + "/") for d in GRADE_REFUSED_DIRS):
                raise ValueError(f"path {path!r} may not be copied from the candidate (system or platform directory)")
            if path not in out:
                out.append(path)
        return out

    @field_validator("tests")
    @classmethod
    def _tests(cls, v: dict[str, str | GradeFile]) -> dict[str, str | GradeFile]:
        if len(v) > MAX_GRADE_FILES:
            raise ValueError(f"at most {MAX_GRADE_FILES} test files")
        total = 0
        for name, content in v.items():
            rel = name[len(GRADE_DIR) + 1 :] if name.startswith(GRADE_DIR + "/") else name
            if len(name) > MAX_TEST_FILE_NAME or not rel or rel.startswith("/") or clean_abs("/" + rel) != "/" + rel:
                raise ValueError(f"test file {name!r}: expected a clean path relative to {GRADE_DIR}")
            size = len(content.encode()) if isinstance(content, str) else len(content.data())
            if size > MAX_GRADE_FILE:
                raise ValueError(f"test file {name!r} has {size} bytes, over the {MAX_GRADE_FILE}-byte limit")
            total += size
        if total > MAX_GRADE_TOTAL:
            raise ValueError(f"test files take {total} bytes, over the {MAX_GRADE_TOTAL}-byte limit")
        return v

    def test_files(self) -> dict[str, bytes]:
        """Absolute path in the sibling -> bytes."""
        out = {}
        for name, content in self.tests.items():
            rel = name[len(GRADE_DIR) + 1 :] if name.startswith(GRADE_DIR + "/") else name
            out[f"{GRADE_DIR}/{rel}"] = content.encode() if isinstance(content, str) else content.data()
        return out


class GradeResult(BaseModel):
    result: ExecResult = Field(description="The command's result, observed from the host.")
    sandbox_id: str = Field(description="The sibling sandbox that ran it (destroyed when the call returns).")
    image: str = Field(description="Name of the image graded on.")
    image_digest: str = Field(description="The exact image version graded on.")
    copied_bytes: int = Field(description="Bytes of archives and files copied from the candidate.")
    create_seconds: float
    copy_seconds: float
    run_seconds: float
    seconds: float = Field(description="The whole call, the sibling's teardown included.")
