"""A pseudo-terminal for a command: the size a caller asks for when it starts the command, and each
time it resizes it.

The kernel keeps a terminal's size in ``struct winsize`` as unsigned 16-bit rows and columns; a size
of zero makes full-screen programs fall back to guesses, so both sides start at one.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

MAX_TERMINAL_SIDE = 65535  # struct winsize holds unsigned shorts


class PtySize(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    rows: int = Field(ge=1, le=MAX_TERMINAL_SIDE, description="Lines of the terminal.")
    cols: int = Field(ge=1, le=MAX_TERMINAL_SIDE, description="Columns of the terminal.")
