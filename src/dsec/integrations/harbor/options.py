"""dsec's own settings of a Harbor environment: what ``harbor run --ek KEY=VALUE`` may set.

Harbor hands every ``--ek`` pair to the environment's constructor (values parsed as JSON where they
parse), and its job config records them in the jobs directory: so there is no key for the daemon's token
here (``DSEC_URL`` and ``DSEC_TOKEN`` in the environment name the daemon).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# Bytes of each output stream a command keeps (its head and tail beyond that; the daemon allows 64 MiB):
# Harbor's Docker environment returns all of it, and agents log what they get.
DEFAULT_OUTPUT_LIMIT = 16 << 20


class DsecOptions(BaseModel):
    """``--ek`` keys of ``dsec.integrations.harbor:DsecEnvironment``."""

    # A misspelt key is an error, not a setting silently dropped.
    model_config = ConfigDict(extra="forbid")

    kind: str = "container"
    """The sandbox kind: container, microvm, vm."""
    sandbox_timeout: float = Field(24 * 3600.0, gt=0, le=7 * 24 * 3600.0)
    """The sandbox's time to live in seconds: the daemon reaps it then, whatever happens to harbor."""
    pids: int | None = Field(None, ge=8)
    """Processes and threads the sandbox may hold (dsec's default when None)."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Labels of the sandbox (``dsec ps --label``), besides harness, harbor.task and harbor.session."""
    output_limit: int = Field(DEFAULT_OUTPUT_LIMIT, ge=1024, le=64 << 20)
    pull: Literal["if-not-present", "always"] = "if-not-present"
    """For a task's ``docker_image``: ``always`` asks the registry whether the tag moved."""
    wait_for_capacity: float = Field(600.0, ge=0)
    """Seconds a full node may take to admit the sandbox before the trial fails with ``Overloaded``."""
