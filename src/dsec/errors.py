"""The error hierarchy shared by the SDK and the daemon.

Every error has a stable machine-readable ``code``; the wire carries the code and the message, and
both sides map codes to classes through :data:`ERRORS_BY_CODE`, so a client re-raises the same class
the core raised. Subclasses also inherit the builtin that fits, so ``except TimeoutError`` works.
"""

from __future__ import annotations

import errno
import sqlite3
from typing import ClassVar


class DsecError(Exception):
    """Root of every error dsec raises."""

    code: ClassVar[str] = "internal"
    http_status: ClassVar[int] = 500

    def __init__(self, message: str, *, detail: dict[str, object] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail or {}
        self.index: int | None = None  # a failed creation of a batch (create_many): which one

    def __str__(self) -> str:
        return self.message


class InvalidRequest(DsecError, ValueError):
    """The request is malformed or asks for something impossible."""

    code = "invalid_request"
    http_status = 400


class Unauthorized(DsecError, PermissionError):
    """Missing or wrong bearer token."""

    code = "unauthorized"
    http_status = 401


class Forbidden(DsecError, PermissionError):
    """The token is valid but its tenant may not do this (tenant administration, gc, import)."""

    code = "forbidden"
    http_status = 403


class NotFound(DsecError, LookupError):
    """Generic: the named thing does not exist."""

    code = "not_found"
    http_status = 404


class MethodNotAllowed(DsecError):
    """The path exists but does not take this method (the answer's Allow header lists those it does)."""

    code = "method_not_allowed"
    http_status = 405


class SandboxNotFound(NotFound):
    """No sandbox with this id."""

    code = "sandbox_not_found"


class ImageNotFound(NotFound):
    """No image with this name."""

    code = "image_not_found"


class FileNotFoundInSandbox(NotFound, FileNotFoundError):
    """The path does not exist inside the sandbox."""

    code = "file_not_found"


class InvalidState(DsecError):
    """The sandbox's lifecycle state does not allow this action."""

    code = "invalid_state"
    http_status = 409


class SandboxGone(InvalidState):
    """The sandbox stopped, failed or was lost; it can no longer be used."""

    code = "sandbox_gone"
    http_status = 410


class ImageExists(DsecError, FileExistsError):
    """A published image version is immutable: its name cannot be given to other content."""

    code = "image_exists"
    http_status = 409


class TenantExists(DsecError, FileExistsError):
    """A tenant with this name exists or existed: names are never given to a second tenant."""

    code = "tenant_exists"
    http_status = 409


class IdempotencyConflict(InvalidState):
    """A request carried the Idempotency-Key of an earlier one that it cannot be answered for: another
    request's key, or one whose answer was cut off or too large to keep (it is never run twice)."""

    code = "idempotency_conflict"


class ImageInUse(InvalidState):
    """The image is used by a live sandbox or is the parent of a kept image."""

    code = "image_in_use"


class VolumeNotFound(NotFound):
    """No volume with this name (or another tenant's)."""

    code = "volume_not_found"


class CheckpointNotFound(NotFound):
    """The sandbox has no checkpoint of this id or name."""

    code = "checkpoint_not_found"


class VolumeExists(DsecError, FileExistsError):
    """A volume with this name exists on the node."""

    code = "volume_exists"
    http_status = 409


class VolumeInUse(InvalidState):
    """The volume is mounted by a live sandbox: it cannot be removed, or mounted read-write by a second."""

    code = "volume_in_use"


class QuotaExceeded(DsecError):
    """A limit on the number or size of sandboxes was reached."""

    code = "quota_exceeded"
    http_status = 429


class Overloaded(QuotaExceeded):
    """No capacity for the creation within its queue deadline (or the queue is full): nothing was
    created. ``detail['retry_after']`` (also the Retry-After header) says when to try again."""

    code = "overloaded"
    http_status = 429

    @property
    def retry_after(self) -> float:
        value = self.detail.get("retry_after", 1.0)
        return float(value) if isinstance(value, int | float) else 1.0


class LimitExceeded(DsecError, OSError):
    """A sandbox limit (disk, output, request size) stopped the operation."""

    code = "limit_exceeded"
    http_status = 413


class StorageFull(DsecError, OSError):
    """The node's own storage (its state directory, layer cache or database) has no space left: the
    request could not be recorded or carried out. Not a sandbox's limit (that is ``LimitExceeded``)."""

    code = "storage_full"
    http_status = 507


class SandboxTimeout(DsecError, TimeoutError):
    """An operation did not finish within its deadline."""

    code = "timeout"
    http_status = 504


class DaemonUnreachable(DsecError, ConnectionError):
    """The SDK could not reach the daemon."""

    code = "daemon_unreachable"
    http_status = 503


class BackendError(DsecError, RuntimeError):
    """The runtime under a sandbox kind failed (crun, QEMU, ...)."""

    code = "backend_error"
    http_status = 500


class KindUnavailable(BackendError):
    """A kind's probe found a named prerequisite missing on this node (no QEMU binary, not root, no OCI
    runtime, ...): the node runs without that kind. Anything else a kind's start raises is a bug, and the
    daemon does not start."""

    code = "kind_unavailable"
    http_status = 501


class BuildFailed(BackendError):
    """An image build step exited non-zero, or produced a layer that may not be published."""

    code = "build_failed"
    http_status = 422


class ResidueFound(DsecError, ValueError):
    """An image publish was refused: a canary string (an answer key's marker) is in one of its layers."""

    code = "residue_found"
    http_status = 422


class TrajectoryDiverged(InvalidState, ValueError):
    """A call in a trajectory differs from the one recorded at its position (``detail``: position,
    recorded and given digests, the recorded call's op), or skips positions. Nothing was run."""

    code = "trajectory_diverged"
    http_status = 409


class CallInterrupted(InvalidState):
    """The recorded call at this position of a trajectory was interrupted (the daemon died, or the
    caller went away, while it ran): whether it took effect is unknown, so it is not replayed as done."""

    code = "call_interrupted"
    http_status = 409


class RegistryError(DsecError, RuntimeError):
    """An OCI registry (or its mirror, or its token service) answered something a pull cannot use: a server
    error that outlasted the retries, a rate limit, a malformed manifest. The message names the registry."""

    code = "registry_error"
    http_status = 502


class RegistryUnreachable(RegistryError, ConnectionError):
    """An OCI registry could not be reached (connection refused, TLS failure, timeout) after the retries;
    the message names the host."""

    code = "registry_unreachable"


class RegistryAuthFailed(RegistryError, PermissionError):
    """An OCI registry refused the node's credentials for it (or anonymous access): not dsec's own token,
    which is ``Unauthorized``. The message names the registry and whose credentials were tried."""

    code = "registry_auth_failed"
    http_status = 403


class DigestMismatch(RegistryError, ValueError):
    """Content from a registry does not match the digest that names it (a pinned digest, a descriptor's, or
    the registry's own Docker-Content-Digest): it was not used."""

    code = "digest_mismatch"


class PortUnreachable(DsecError, ConnectionError):
    """An exposed port of a sandbox could not be reached: nothing listens on it inside the sandbox, or it
    did not accept in time. The sandbox itself is fine."""

    code = "port_unreachable"
    http_status = 502


ERRORS_BY_CODE: dict[str, type[DsecError]] = {
    cls.code: cls
    for cls in (
        DsecError,
        InvalidRequest,
        Unauthorized,
        Forbidden,
        NotFound,
        MethodNotAllowed,
        SandboxNotFound,
        ImageNotFound,
        ImageExists,
        ImageInUse,
        VolumeNotFound,
        CheckpointNotFound,
        VolumeExists,
        VolumeInUse,
        IdempotencyConflict,
        TenantExists,
        FileNotFoundInSandbox,
        InvalidState,
        SandboxGone,
        QuotaExceeded,
        Overloaded,
        LimitExceeded,
        StorageFull,
        SandboxTimeout,
        DaemonUnreachable,
        BackendError,
        KindUnavailable,
        BuildFailed,
        ResidueFound,
        TrajectoryDiverged,
        CallInterrupted,
        RegistryError,
        RegistryUnreachable,
        RegistryAuthFailed,
        DigestMismatch,
        PortUnreachable,
    )
}


def environment_error(exc: BaseException) -> DsecError | None:
    """The clear error for a failure of the node's environment that reached a handler untranslated (a
    full disk under SQLite or a file write), or None: the one place this mapping is made, for every API."""
    cause = getattr(exc, "orig", None) or exc  # SQLAlchemy wraps the driver's error
    if isinstance(cause, sqlite3.Error) and getattr(cause, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
        return StorageFull(f"the node's storage is full: its database cannot be written ({cause})")
    if isinstance(cause, OSError) and not isinstance(cause, DsecError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
        where = f" ({cause.filename})" if cause.filename else ""
        return StorageFull(f"the node's storage is full{where}: {cause.strerror}")
    return None


def validation_message(exc: Exception) -> str:
    """A one-line summary of a pydantic ValidationError (field: problem; ...)."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc)
    parts = []
    for err in errors()[:5]:
        loc_parts = list(err.get("loc", ()))
        if loc_parts and loc_parts[0] in ("body", "query", "path"):  # where it came from, not a field name
            loc_parts = loc_parts[1:]
        loc = ".".join(str(x) for x in loc_parts)
        parts.append(f"{loc or 'request'}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


def error_from_wire(code: str, message: str, detail: dict[str, object] | None = None) -> DsecError:
    """Rebuild the error a server reported; unknown codes become the root class."""
    cls = ERRORS_BY_CODE.get(code, DsecError)
    err = cls(message, detail=detail)
    return err
