"""dsec: elastic sandboxes for training and evaluating AI agents."""

from __future__ import annotations

__version__ = "0.1.0"

from .errors import (
    BackendError,
    BuildFailed,
    CallInterrupted,
    DaemonUnreachable,
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
    NotFound,
    Overloaded,
    QuotaExceeded,
    ResidueFound,
    SandboxGone,
    SandboxNotFound,
    SandboxTimeout,
    StorageFull,
    TenantExists,
    TrajectoryDiverged,
    Unauthorized,
)
from .grade_models import GradeResult
from .images.buildspec import BuildSpec, ImageSpec
from .models import ExecResult, FileEntry, ImageInfo, NetworkAllow, NetworkStatus, SandboxInfo, State
from .run_models import PoolInfo, RunResult
from .sdk.aio import AsyncClient, AsyncSandbox
from .sdk.sync import Client, Sandbox, run
from .sdk.trajectory import Trajectory
from .trajectory_models import RecordedCall, TrajectoryInfo

__all__ = [
    "AsyncClient",
    "AsyncSandbox",
    "BackendError",
    "BuildFailed",
    "BuildSpec",
    "CallInterrupted",
    "Client",
    "DaemonUnreachable",
    "DsecError",
    "ExecResult",
    "FileEntry",
    "FileNotFoundInSandbox",
    "Forbidden",
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
    "NetworkAllow",
    "NetworkStatus",
    "NotFound",
    "Overloaded",
    "PoolInfo",
    "QuotaExceeded",
    "RecordedCall",
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
    "__version__",
    "run",
]
