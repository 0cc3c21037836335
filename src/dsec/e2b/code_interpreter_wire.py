"""What the ``e2b-code-interpreter`` package sends to its Jupyter server and reads back, and how dsec's
code results become that: ``/execute`` answers JSON lines (``stdout``, ``stderr``, ``result``, ``error``,
``number_of_executions``, ``end_of_execution``); a context is ``{id, language, cwd}``."""

from __future__ import annotations

import json
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..errors import InvalidRequest
from ..protocol.code import MAX_CODE, CodeResult, MimeBundle
from ..protocol.languages import LanguageName

# E2B's language names (and dsec's own) -> dsec's. Only python keeps a context's state.
LANGUAGES: dict[str, LanguageName] = {
    "python": "python",
    "python3": "python",
    "javascript": "nodejs",
    "js": "nodejs",
    "nodejs": "nodejs",
    "bash": "bash",
    "sh": "sh",
    "java": "java",
    "c": "c",
    "cpp": "cpp",
    "go": "go",
}
# a MIME type of a Jupyter bundle -> the field of E2B's Result that holds it; others go to ``extra``
MIME_FIELDS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
    "e2b/data": "data",  # a DataFrame's columns (dsec/e2b-code-interpreter:1's kernel sends it, as E2B's does)
    "e2b/chart": "chart",
}
JSON_FIELDS = frozenset({"json", "data", "chart"})
MAX_ENV = 256


class ExecuteBody(BaseModel):
    model_config = ConfigDict(extra="ignore")  # the package may send more in later versions

    code: str = Field(max_length=MAX_CODE)
    context_id: str | None = Field(None, max_length=200)
    language: str | None = Field(None, max_length=64)
    env_vars: dict[str, str] | None = Field(None, max_length=MAX_ENV)


class CreateContextBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    language: str | None = Field(None, max_length=64)
    cwd: str | None = Field(None, min_length=1, max_length=4096, pattern=r"^[^\x00]*$")


class ContextOut(BaseModel):
    id: str
    language: str
    cwd: str


def language(name: str | None) -> LanguageName:
    """dsec's language for E2B's name (None: python); a language dsec cannot run is refused by name."""
    if name is None:
        return "python"
    found = LANGUAGES.get(name.lower())
    if found is None:
        raise InvalidRequest(
            f"language {name[:64]!r} is not one dsec runs; it runs {', '.join(sorted(LANGUAGES))} "
            "(only python keeps its state between calls)"
        )
    return found


def check_env(env: dict[str, str] | None) -> dict[str, str] | None:
    for key, value in (env or {}).items():
        if not key or "=" in key or "\0" in key or "\0" in value:
            raise InvalidRequest(f"env_vars: {key[:64]!r} is not a valid environment variable")
    return env or None


def result_line(bundle: MimeBundle, main: bool) -> dict[str, Any]:
    """One Jupyter bundle as E2B's ``result`` line (its Result's fields)."""
    line: dict[str, Any] = {"type": "result", "is_main_result": main}
    extra: dict[str, str] = {}
    for mime, value in bundle.items():
        field = MIME_FIELDS.get(mime)
        if field is None:
            extra[mime] = value
        elif field == "text":
            line[field] = unquoted(value)
        elif field in JSON_FIELDS:
            try:
                line[field] = json.loads(value)
            except ValueError:
                line[field] = value
        else:
            line[field] = value
    if extra:
        line["extra"] = extra
    return line


def unquoted(text: str) -> str:
    """A string's value as E2B's server gives it: without the quotes of its repr (``'x'`` is ``x``)."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def execution_lines(res: CodeResult, stateful: bool, streamed: bool = False) -> bytes:
    """A cell's outcome as the JSON lines ``/execute`` streams: its output (unless ``streamed`` already, as
    it was written), displays, value, error and count."""
    now = time.time_ns()
    lines: list[dict[str, Any]] = []
    for stream in () if streamed else ("stdout", "stderr"):
        text: str = getattr(res, stream)
        if text:
            lines.append({"type": stream, "text": text, "timestamp": now})
    if res.truncated:
        note = "[dsec: output past 1 MiB per stream or 16 MiB of rich data was dropped]\n"
        lines.append({"type": "stderr", "text": note, "timestamp": now})
    lines += [result_line(b, main=False) for b in res.outputs]
    if res.result is not None:
        lines.append(result_line(res.result, main=True))
    if res.error is not None:
        e = res.error
        lines.append({"type": "error", "name": e.name, "value": e.value, "traceback": "\n".join(e.traceback)})
    if stateful:
        lines.append({"type": "number_of_executions", "execution_count": res.execution_count})
    lines.append({"type": "end_of_execution"})
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)
