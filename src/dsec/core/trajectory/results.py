"""How a recorded call's error is stored and read back, and what a rebuild compares between a recorded
result and a re-run's."""

from __future__ import annotations

import json
from typing import Any

from ...errors import DsecError, error_from_wire
from ...protocol.checkpoints import CheckpointInfo
from ...protocol.sandbox import ExecResult, SandboxInfo
from ...protocol.trajectory import call_digest
from ..actions import Action


def encode_error(e: DsecError) -> str:
    return json.dumps({"error": {"code": e.code, "message": e.message, "detail": e.detail}}, default=str)


def decode_error(result: str | None) -> DsecError:
    try:
        err = json.loads(result or "")["error"]
        return error_from_wire(str(err["code"]), str(err["message"]), err.get("detail") or {})
    except (ValueError, KeyError, TypeError):
        return DsecError("the recorded call failed (its error could not be read back)")


def outcome(op: Action, value: Any) -> str:
    """What a rebuild compares between a recorded result and a re-run's: the result without timings."""
    if isinstance(value, ExecResult):
        value = value.model_copy(update={"duration": 0.0, "replayed": False})
    elif isinstance(value, CheckpointInfo):  # which checkpoint it is; not when, how big or whose
        return call_digest(op.name, {"id": value.id, "name": value.name})
    elif op.name == "rollback" and isinstance(value, SandboxInfo):
        return call_digest(op.name, {"state": value.state.value})
    text, blob = op.encode(value)
    return call_digest(op.name, {"result": text}, blob)
