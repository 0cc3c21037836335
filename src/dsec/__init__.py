"""dsec: elastic sandboxes for training and evaluating AI agents.

The client (``Sandbox``, ``Client``, ``run``, ...) is loaded on first use: the daemon's modules live in
this package too, and importing any of them must not load the SDK.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .errors import (
    BackendError,
    BuildFailed,
    CallInterrupted,
    CheckpointNotFound,
    DaemonUnreachable,
    DigestMismatch,
    DsecError,
    FileNotFoundInSandbox,
    Forbidden,
    IdempotencyConflict,
    ImageExists,
    ImageInUse,
    ImageNotFound,
    InvalidRequest,
    InvalidState,
    KindUnavailable,
    LimitExceeded,
    MethodNotAllowed,
    NotFound,
    Overloaded,
    PortUnreachable,
    QuotaExceeded,
    RegistryAuthFailed,
    RegistryError,
    RegistryUnreachable,
    ResidueFound,
    SandboxGone,
    SandboxNotFound,
    SandboxTimeout,
    StorageFull,
    TenantExists,
    TrajectoryDiverged,
    Unauthorized,
    VolumeExists,
    VolumeInUse,
    VolumeNotFound,
)
from .protocol.build import BuildSpec, ImageSpec
from .protocol.checkpoints import CheckpointInfo, CheckpointSupport
from .protocol.code import CodeError, CodeResult
from .protocol.grade import GradeResult
from .protocol.network import NetworkAllow, NetworkDeny
from .protocol.pools import WarmPoolInfo, WarmPoolSpec
from .protocol.pull import PullProgress, PushResult
from .protocol.run import PoolInfo, RunResult
from .protocol.sandbox import BuildResult, ExecResult, FileEntry, ImageInfo, NetworkStatus, SandboxInfo, State
from .protocol.trajectory import RecordedCall, TrajectoryInfo
from .protocol.version import __version__
from .protocol.volumes import VolumeInfo

if TYPE_CHECKING:
    from .sdk.aio import AsyncClient, AsyncSandbox
    from .sdk.checkpoints import Forked
    from .sdk.sync import Client, Sandbox, run
    from .sdk.trajectory import Trajectory

_CLIENT = {
    "AsyncClient": ".sdk.aio",
    "AsyncSandbox": ".sdk.aio",
    "Client": ".sdk.sync",
    "Sandbox": ".sdk.sync",
    "run": ".sdk.sync",
    "Trajectory": ".sdk.trajectory",
    "Forked": ".sdk.checkpoints",
}

__all__ = [
    "AsyncClient",
    "AsyncSandbox",
    "BackendError",
    "BuildFailed",
    "BuildResult",
    "BuildSpec",
    "CallInterrupted",
    "CheckpointInfo",
    "CheckpointNotFound",
    "CheckpointSupport",
    "Client",
    "CodeError",
    "CodeResult",
    "DaemonUnreachable",
    "DigestMismatch",
    "DsecError",
    "ExecResult",
    "FileEntry",
    "FileNotFoundInSandbox",
    "Forbidden",
    "Forked",
    "GradeResult",
    "IdempotencyConflict",
    "ImageExists",
    "ImageInUse",
    "ImageInfo",
    "ImageNotFound",
    "ImageSpec",
    "InvalidRequest",
    "InvalidState",
    "KindUnavailable",
    "LimitExceeded",
    "MethodNotAllowed",
    "NetworkAllow",
    "NetworkDeny",
    "NetworkStatus",
    "NotFound",
    "Overloaded",
    "PoolInfo",
    "PortUnreachable",
    "PullProgress",
    "PushResult",
    "QuotaExceeded",
    "RecordedCall",
    "RegistryAuthFailed",
    "RegistryError",
    "RegistryUnreachable",
    "ResidueFound",
    "RunResult",
    "Sandbox",
    "SandboxGone",
    "SandboxInfo",
    "SandboxNotFound",
    "SandboxTimeout",
    "State",
    "StorageFull",
    "TenantExists",
    "Trajectory",
    "TrajectoryDiverged",
    "TrajectoryInfo",
    "Unauthorized",
    "VolumeExists",
    "VolumeInUse",
    "VolumeInfo",
    "VolumeNotFound",
    "WarmPoolInfo",
    "WarmPoolSpec",
    "__version__",
    "run",
]


def __getattr__(name: str) -> object:
    module = _CLIENT.get(name)
    if module is None:
        raise AttributeError(f"module 'dsec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # found directly from now on
    return value
