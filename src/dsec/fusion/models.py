"""The SandboxFusion API's wire models, as the ``sandbox-fusion`` client (0.3.x) sends and reads them
(its ``RunCodeRequest``, ``RunCodeResponse``, ``CommandRunResult``), with the bounds dsec holds them to.

Fields a client sends that are not here are ignored, as SandboxFusion's own server ignores them: clients
of other versions keep working. ``memory_limit_MB``, which verl sends, is read (service.py).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..protocol.run import MAX_CODE, MAX_RUN_FILES, MAX_RUN_TOTAL, RUN_DIR
from ..protocol.sandbox import MAX_MEMORY, MAX_STDIN, MIN_MEMORY
from ..protocol.types import PATH_MAX, PATH_NO_DOTDOT, clean_abs

MAX_TIMEOUT_S = 3600.0  # a call is one program's compile and run, each bounded by its own timeout
MAX_LANGUAGE = 64
MAX_CELLS = 256
MIB = 1 << 20


def run_path(path: str) -> str:
    """Where a request's file path is in the sandbox: relative paths are under the run's directory (as
    SandboxFusion's are under its temporary directory), absolute ones where they say; no '..'."""
    if not path or "\0" in path or len(path) > PATH_MAX:
        raise ValueError(f"file path {path[:80]!r} is empty, too long or contains NUL")
    return clean_abs(path if path.startswith("/") else f"{RUN_DIR}/{path}", "file path")


class _WithFiles(BaseModel):
    """What both calls take besides their code: files in, files back, a memory limit."""

    model_config = ConfigDict(extra="ignore")

    files: dict[str, str | None] = Field(
        default_factory=dict,
        json_schema_extra={
            "maxProperties": MAX_RUN_FILES,
            "propertyNames": {"minLength": 1, "maxLength": PATH_MAX, "pattern": PATH_NO_DOTDOT},
        },
        description=f"Files written before the compile: path (relative: under {RUN_DIR}) -> content in base64 "
        f"(null: skipped, as SandboxFusion does); {MAX_RUN_TOTAL} bytes in all.",
    )
    fetch_files: list[str] = Field(
        default_factory=list,
        max_length=MAX_RUN_FILES,
        description="Files read back after the run, base64 in the answer's files; those that are not regular "
        "files are left out.",
    )
    memory_limit_MB: int | None = Field(  # the wire's name, as verl sends it
        None,
        le=MAX_MEMORY // MIB,
        description=f"The sandbox's memory limit in MiB (at least {MIN_MEMORY // MIB}); 0, a negative "
        "number or none: the server's default.",
    )

    @field_validator("files")
    @classmethod
    def _files(cls, v: dict[str, str | None]) -> dict[str, str | None]:
        if len(v) > MAX_RUN_FILES:
            raise ValueError(f"at most {MAX_RUN_FILES} files")
        total = 0
        for path, content in v.items():
            run_path(path)
            if content is not None:
                total += len(_decode(path, content))
        if total > MAX_RUN_TOTAL:
            raise ValueError(f"files hold {total} bytes, over the {MAX_RUN_TOTAL}-byte limit")
        return v

    @field_validator("fetch_files")
    @classmethod
    def _fetch_files(cls, v: list[str]) -> list[str]:
        for path in v:
            run_path(path)
        return v

    @field_validator("memory_limit_MB")
    @classmethod
    def _memory(cls, v: int | None) -> int | None:
        if v is not None and 0 < v < MIN_MEMORY // MIB:
            raise ValueError(f"memory_limit_MB must be at least {MIN_MEMORY // MIB} (or <= 0 for the default)")
        return v

    def file_bytes(self) -> dict[str, bytes]:
        """Absolute path in the sandbox -> content, of the files that have one."""
        return {run_path(p): _decode(p, c) for p, c in self.files.items() if c is not None}

    def memory(self) -> int | None:
        """The memory limit asked for, in bytes; None: the server's default."""
        return self.memory_limit_MB * MIB if self.memory_limit_MB is not None and self.memory_limit_MB > 0 else None


class RunCodeRequest(_WithFiles):
    code: str = Field(..., max_length=MAX_CODE, description="The source to run.")
    language: str = Field(
        ..., min_length=1, max_length=MAX_LANGUAGE, description="python, bash, sh, c, cpp, go, java or nodejs."
    )
    compile_timeout: float = Field(10, gt=0, le=MAX_TIMEOUT_S, description="Seconds the compile may take.")
    run_timeout: float = Field(10, gt=0, le=MAX_TIMEOUT_S, description="Seconds the program may run.")
    stdin: str | None = Field(None, max_length=MAX_STDIN, description="Text fed to the program's standard input.")


class RunJupyterRequest(_WithFiles):
    cells: list[str] = Field(
        ..., min_length=1, max_length=MAX_CELLS, description="Python cells, run in order in one kernel."
    )
    cell_timeout: float = Field(
        0, ge=0, le=MAX_TIMEOUT_S, description="Seconds each cell may take; 0: no limit but the total."
    )
    total_timeout: float = Field(45, gt=0, le=MAX_TIMEOUT_S, description="Seconds all the cells may take.")
    kernel: str = Field("python3", max_length=MAX_LANGUAGE, description="Only 'python3'.")

    @field_validator("cells")
    @classmethod
    def _cells(cls, v: list[str]) -> list[str]:
        if sum(len(c) for c in v) > MAX_CODE:
            raise ValueError(f"the cells hold more than {MAX_CODE} characters in all")
        return v


def _decode(path: str, content: str) -> bytes:
    try:
        return base64.b64decode(content, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"file {path[:80]!r}: its content is not valid base64") from None


CommandRunStatus = Literal["Finished", "Error", "TimeLimitExceeded"]
RunStatus = Literal["Success", "Failed", "SandboxError"]


class CommandRunResult(BaseModel):
    status: CommandRunStatus = Field(
        description="Finished: the process ended by itself; TimeLimitExceeded: killed at its timeout; "
        "Error: it could not be run."
    )
    execution_time: float | None = Field(None, description="Seconds, wall clock.")
    cpu_time: float | None = Field(None, description="Not measured by dsec: always null.")
    return_code: int | None = Field(
        None, description="Exit status; minus the signal's number for a process a signal ended; null on a timeout."
    )
    stdout: str | None = None
    stderr: str | None = None


class RunCodeResponse(BaseModel):
    status: RunStatus = Field(
        description="Success: every step finished with status 0; Failed: a step failed or timed out; "
        "SandboxError: the code could not be run (message says why)."
    )
    message: str = ""
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = Field(None, description="The id of the dsec sandbox that ran the call.")
    files: dict[str, str] = Field(default_factory=dict, description="fetch_files' path -> content in base64.")

    @classmethod
    def sandbox_error(cls, message: str) -> RunCodeResponse:
        return cls(status="SandboxError", message=message)


class CellRunResult(BaseModel):
    stdout: str = ""
    stderr: str = ""
    display: list[dict[str, str]] = Field(
        default_factory=list, description="The cell's displays, then its last expression's value: MIME type -> content."
    )
    error: list[dict[str, Any]] = Field(default_factory=list, description="{ename, evalue, traceback} of its error.")


class RunJupyterResponse(BaseModel):
    status: RunStatus = Field(
        description="Success: every cell ran (a cell's own error is in its result); Failed: the time ran out; "
        "SandboxError: the cells could not be run (message says why)."
    )
    message: str = ""
    driver: CommandRunResult | None = Field(None, description="The whole run: Finished or TimeLimitExceeded.")
    cells: list[CellRunResult] = Field(default_factory=list, description="One per cell that ran, in order.")
    executor_pod_name: str | None = Field(None, description="The id of the dsec sandbox that ran the call.")
    files: dict[str, str] = Field(default_factory=dict, description="fetch_files' path -> content in base64.")
