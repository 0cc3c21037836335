"""Whether a container's processes could be checkpointed here: CRIU's own check, run once at start.

Checkpoints of containers keep their files (core/checkpoints.py). Keeping their processes and memory
too needs CRIU, and CRIU follows the kernel closely: the Debian 12 package (3.17.1) cannot even start
its feature detection on a 6.18 kernel ("vdso: Unexpected rt vDSO area bounds"). The node says what
CRIU answered, word for word, rather than offering what it cannot do.
"""

from __future__ import annotations

import os
import shutil

from ...proc import run

_answer: str | None = None  # once per process: the function kind's own container backend asks too


async def processes_unsupported() -> str:
    """Why this node's container checkpoints keep files only (always a reason: see below)."""
    global _answer
    if _answer is None:
        _answer = await _probe()
    return _answer


async def _probe() -> str:
    exe = shutil.which("criu")
    if exe is None:
        return "CRIU is not installed on this node (Debian package criu)"
    status, out = await run([exe, "--version"], timeout=20)
    version = out.decode(errors="replace").split("Version:", 1)[-1].split()[0] if status == 0 and out else "?"
    status, out = await run([exe, "check"], timeout=60)
    kernel = os.uname().release
    if status != 0:
        errors = [line for line in out.decode(errors="replace").splitlines() if line.startswith("Error")]
        said = errors[0].split("): ", 1)[-1] if errors else f"exit status {status}"
        return f"CRIU {version} cannot checkpoint on this kernel ({kernel}): {said}"
    # CRIU works here, but dsec restores containers from their files only so far
    return f"CRIU {version} passes its checks on this kernel ({kernel}); dsec does not use it for containers yet"
