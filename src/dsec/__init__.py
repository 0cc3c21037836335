"""dsec: elastic sandboxes for training and evaluating AI agents."""

from __future__ import annotations

__version__ = "0.1.0"

from .errors import (  # noqa: E402
    BackendError,
    DaemonUnreachable,
    DsecError,
    FileNotFoundInSandbox,
    ImageNotFound,
    InvalidRequest,
    InvalidState,
    LimitExceeded,
    NotFound,
    QuotaExceeded,
    SandboxGone,
    SandboxNotFound,
    SandboxTimeout,
    Unauthorized,
)
from .models import ExecResult, FileEntry, SandboxInfo, State  # noqa: E402
from .sdk.aio import AsyncClient, AsyncSandbox  # noqa: E402
from .sdk.sync import Client, Sandbox  # noqa: E402

__all__ = [
    "AsyncClient",
    "AsyncSandbox",
    "BackendError",
    "Client",
    "DaemonUnreachable",
    "DsecError",
    "ExecResult",
    "FileEntry",
    "FileNotFoundInSandbox",
    "ImageNotFound",
    "InvalidRequest",
    "InvalidState",
    "LimitExceeded",
    "NotFound",
    "QuotaExceeded",
    "Sandbox",
    "SandboxGone",
    "SandboxInfo",
    "SandboxNotFound",
    "SandboxTimeout",
    "State",
    "Unauthorized",
    "__version__",
]
