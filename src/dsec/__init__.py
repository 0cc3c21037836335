"""dsec: elastic sandboxes for training and evaluating AI agents."""

from __future__ import annotations

__version__ = "0.1.0"

from .errors import (
    BackendError,
    BuildFailed,
    DaemonUnreachable,
    DsecError,
    FileNotFoundInSandbox,
    ImageExists,
    ImageInUse,
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
from .images.buildspec import BuildSpec, ImageSpec
from .models import ExecResult, FileEntry, ImageInfo, SandboxInfo, State
from .sdk.aio import AsyncClient, AsyncSandbox
from .sdk.sync import Client, Sandbox

__all__ = [
    "AsyncClient",
    "AsyncSandbox",
    "BackendError",
    "BuildFailed",
    "BuildSpec",
    "Client",
    "DaemonUnreachable",
    "DsecError",
    "ExecResult",
    "FileEntry",
    "FileNotFoundInSandbox",
    "ImageExists",
    "ImageInUse",
    "ImageInfo",
    "ImageNotFound",
    "ImageSpec",
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
