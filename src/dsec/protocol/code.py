"""Wire models of stateful code execution (``POST /v1/sandboxes/{id}/code``): what ``sb.run_code`` sends and
what comes back, shaped as a Jupyter cell's outcome (streams, the last expression's value, rich displays,
a structured error).

Python code runs in a *context*: a Jupyter kernel in the sandbox where the image has ``ipykernel`` (dsec's
``dsec/code:1`` has), else a persistent interpreter namespace; variables survive between calls of one
context, and each named context is separate.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .languages import LanguageName
from .sandbox import MAX_EXEC_TIMEOUT_S

MAX_CODE = 1 << 20
MAX_CONTEXTS = 16  # per sandbox: each holds an interpreter (a kernel is ~60 MB)
CONTEXT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
DEFAULT_CONTEXT = "default"
CODE_IMAGE = "dsec/code:1"

# A bundle is one value as Jupyter shows it: MIME type -> content (text, or base64 for images).
MimeBundle = dict[str, str]


class CodeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    code: str = Field(
        ..., max_length=MAX_CODE, description="The cell: Python source (statements, then maybe an expression)."
    )
    language: LanguageName = Field(
        "python",
        description="python runs in a context that keeps its state; another language is compiled (if it is) and "
        "run once, its output the result's streams (no context).",
    )
    context: str | None = Field(
        None,
        pattern=CONTEXT_PATTERN,
        description=f"The interpreter state to run in; None: {DEFAULT_CONTEXT!r}. Each name is a separate one "
        f"(at most {MAX_CONTEXTS} per sandbox).",
    )
    timeout: float = Field(
        60.0,
        gt=0,
        le=MAX_EXEC_TIMEOUT_S,
        description="Seconds before the code is interrupted (the context's variables are kept).",
    )


class CodeError(BaseModel):
    name: str = Field(description="The exception's class name, e.g. 'ZeroDivisionError'.")
    value: str = Field(description="Its message.")
    traceback: list[str] = Field(default_factory=list, description="The formatted traceback, one entry per frame.")


class CodeResult(BaseModel):
    stdout: str = ""
    stderr: str = ""
    result: MimeBundle | None = Field(None, description="The value of the cell's last expression, if any.")
    outputs: list[MimeBundle] = Field(
        default_factory=list, description="Rich displays in order: a matplotlib figure is {'image/png': base64, ...}."
    )
    error: CodeError | None = Field(None, description="The error the cell raised, or the timeout that stopped it.")
    execution_count: int = Field(0, ge=0)
    context: str = Field(description="The context the code ran in ('' for another language than python).")
    engine: Literal["jupyter", "python", "process"] = Field(
        description="'jupyter': a Jupyter kernel of the image; 'python': dsec's plain interpreter (no ipykernel); "
        "'process': another language, compiled and run once."
    )
    truncated: bool = Field(False, description="Output past 1 MiB per stream or 16 MiB of rich data was dropped.")
    duration: float = Field(0.0, ge=0, description="Seconds the call took, as the daemon measured it.")

    @property
    def text(self) -> str | None:
        """The last expression's plain-text value ('42' for ``6 * 7``), if there was one."""
        return None if self.result is None else self.result.get("text/plain")

    @property
    def images(self) -> list[str]:
        """The PNG outputs (base64), in order."""
        return [b["image/png"] for b in self.outputs if "image/png" in b]


class CodeContexts(BaseModel):
    contexts: list[str] = Field(default_factory=list)
