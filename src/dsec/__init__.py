"""dsec: elastic sandboxes for training and evaluating AI agents."""

from __future__ import annotations

__version__ = "0.1.0"

from .errors import (
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
from .models import ExecResult, FileEntry, SandboxInfo, State
from .sdk.aio import AsyncClient, AsyncSandbox
from .sdk.sync import Client, Sandbox

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
