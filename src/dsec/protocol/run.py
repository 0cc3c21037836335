"""Wire models of one-shot runs (``POST /v1/run``, ``POST /v1/run/batch``) and of the warm pools that
serve them (``GET /v1/pools``); see core/oneshot.py and kinds/function/."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .grade import GradeFile
from .names import ImageName
from .network import NetworkSpec
from .sandbox import (
    DEFAULT_OUTPUT_CAP,
    MAX_EXEC_TIMEOUT_S,
    MAX_OUTPUT_CAP,
    MAX_STDIN,
    ErrorBody,
    ExecRequest,
    ExecResult,
    Kind,
    Limits,
    _Strict,
)
from .types import PATH_MAX, PATH_NO_DOTDOT, USER_SPEC, CleanAbsPath, Command, Env, clean_abs

RUN_DIR = "/tmp"
MAX_RUN_FILES = 256
MAX_RUN_TOTAL = 32 << 20
MAX_CODE = 1 << 20
MAX_RUNS = 1024  # calls in one run_many request
# what runs ``code`` per language, and where the code is written (in the run's directory)
LANGUAGES: dict[str, tuple[list[str], str]] = {
    "python": (["python3"], "main.py"),
    "bash": (["bash"], "main.sh"),
    "sh": (["/bin/sh"], "main.sh"),
}


class RunRequest(_Strict):
    """One command in a sandbox that exists only for this call: by default lent from a warm pool of the
    ``function`` kind and reset after. Give ``command`` or ``code``, not both."""

    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [
                {"required": ["command"], "properties": {"command": {"type": ["string", "array"]}}},
                {"required": ["code"], "properties": {"code": {"type": "string"}}},
            ]
        }
    )

    image: ImageName = Field("dsec/debian:12")
    kind: Kind = Field("function", description="Sandbox kind ('function': from a warm pool).")
    command: Command | None = Field(
        None, description="A string is run by /bin/sh -c; a list is the argv. Exclusive with code."
    )
    code: str | None = Field(
        None, max_length=MAX_CODE, description="Source run by the language's interpreter from a file in cwd."
    )
    language: Literal["python", "bash", "sh"] = Field("python", description="The interpreter of code.")
    stdin: str | None = Field(None, max_length=MAX_STDIN, description="Text fed to standard input.")
    files: dict[str, str | GradeFile] = Field(
        default_factory=dict,
        json_schema_extra={
            "maxProperties": MAX_RUN_FILES,
            "propertyNames": {"minLength": 1, "maxLength": PATH_MAX, "pattern": PATH_NO_DOTDOT},
        },
        description=f"Files written before the command: path (relative paths are under cwd; no '..') -> content "
        f"({MAX_RUN_TOTAL} bytes in all).",
    )
    cwd: CleanAbsPath = Field(RUN_DIR, description="Working directory; /tmp is emptied between uses.")
    env: Env = Field(default_factory=dict)
    timeout: float = Field(60.0, gt=0, le=MAX_EXEC_TIMEOUT_S, description="Seconds before the whole tree is killed.")
    idle_timeout: float | None = Field(None, gt=0, le=MAX_EXEC_TIMEOUT_S, description="Seconds without output.")
    output_limit: int = Field(DEFAULT_OUTPUT_CAP, ge=1024, le=MAX_OUTPUT_CAP, description="Bytes kept per stream.")
    user: str | None = Field(None, pattern=USER_SPEC, description="Account of the image to run as.")
    limits: Limits = Field(default_factory=lambda: Limits())
    network: NetworkSpec = Field(None, description="As for a sandbox; None: loopback only.")

    @field_validator("files")
    @classmethod
    def _files(cls, v: dict[str, str | GradeFile]) -> dict[str, str | GradeFile]:
        if len(v) > MAX_RUN_FILES:
            raise ValueError(f"at most {MAX_RUN_FILES} files")
        total = 0
        for path, content in v.items():
            if not path or "\0" in path or ".." in path.split("/") or len(path) > PATH_MAX:
                raise ValueError(f"file path {path!r} is empty or contains NUL or '..'")
            total += len(content.content if isinstance(content, GradeFile) else content)
        if total > MAX_RUN_TOTAL:
            raise ValueError(f"files hold {total} bytes, over the {MAX_RUN_TOTAL}-byte limit")
        return v

    @model_validator(mode="after")
    def _one_program(self) -> RunRequest:
        if (self.command is None) == (self.code is None):
            raise ValueError("give exactly one of command and code")
        self.file_bytes()  # every file's path under cwd and its content decode now, not when the run starts
        return self

    def file_bytes(self) -> dict[str, bytes]:
        """Absolute path -> content, the code's file included."""
        out: dict[str, bytes] = {}
        for path, content in self.files.items():
            full = path if path.startswith("/") else f"{self.cwd.rstrip('/')}/{path}"
            out[clean_abs(full, "file path")] = content.data() if isinstance(content, GradeFile) else content.encode()
        if self.code is not None:
            out[f"{self.cwd.rstrip('/')}/{LANGUAGES[self.language][1]}"] = self.code.encode()
        return out

    def exec_request(self) -> ExecRequest:
        if self.code is not None:
            interpreter, name = LANGUAGES[self.language]
            cmd: str | list[str] = [*interpreter, f"{self.cwd.rstrip('/')}/{name}"]
        else:
            assert self.command is not None
            cmd = self.command
        return ExecRequest(
            cmd=cmd,
            timeout=self.timeout,
            idle_timeout=self.idle_timeout,
            cwd=self.cwd,
            env=self.env,
            stdin=self.stdin,
            user=self.user,
            output_limit=self.output_limit,
        )


class RunResult(ExecResult):
    sandbox: str = Field(description="The id of the sandbox the call ran in (gone by now).")
    warm: bool = Field(False, description="Served by a worker that was already warm (a pool hit).")


class RunBatch(_Strict):
    runs: list[RunRequest] = Field(..., min_length=1, max_length=MAX_RUNS)
    concurrency: int = Field(64, ge=1, le=1024, description="How many of the runs are in flight at once.")


class RunOutcome(BaseModel):
    """A run's result, or why it could not run (the other runs of the batch go on)."""

    result: RunResult | None = None
    error: ErrorBody | None = None


class RunBatchResult(BaseModel):
    outcomes: list[RunOutcome] = Field(description="One per run, in the order given.")
    seconds: float


class PoolInfo(BaseModel):
    tenant: str
    image: str = Field(description="The image and limits the pool's workers are made with.")
    workers: int = Field(description="Workers that exist (lent, idle, being made or reset).")
    idle: int
    lent: int
    min_idle: int
    max_workers: int
    hits: int = Field(description="Uses served by an idle warm worker.")
    misses: int = Field(description="Uses that had to wait for a worker to be made.")
    made: int
    destroyed: int
    resets: int = Field(description="Resets verified clean (the worker went back to the pool).")
    rejected: int = Field(description="Workers destroyed after a hostile use or a failed verification.")
    waited: int = Field(description="Uses that queued because the pool was at its maximum.")


class PoolList(BaseModel):
    pools: list[PoolInfo]
