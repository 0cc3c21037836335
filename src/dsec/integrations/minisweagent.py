"""mini-swe-agent (2.4.6) with its commands run in a dsec sandbox: ``DsecEnvironment``.

Select it in a mini-swe-agent config::

    environment:
      environment_class: dsec.integrations.minisweagent.DsecEnvironment
      image: dsec/debian:12
      cwd: /repo

or build it directly: ``DsecEnvironment(image=..., cwd=..., timeout=...)``. The sandbox is created when
the environment is (as mini-swe-agent's docker environment starts its container) and killed by
``cleanup()``, by leaving a ``with`` block, when the object is collected, or at interpreter exit; its time
to live (``sandbox_timeout``) bounds it whatever happens to this process. ``env.sandbox`` is the
``dsec.Sandbox``, for setting a task up and grading it.

Commands behave as in mini-swe-agent's local and docker environments: stdout and stderr in one stream, a
timeout reported as ``returncode`` -1 with the output so far and the same ``exception_info``, and the
submission signal raising mini-swe-agent's ``Submitted``. Failures of the platform (the sandbox gone, the
daemon unreachable) raise their ``dsec.DsecError`` instead of being shown to the model as a command's
failure: no later command could succeed, and a trainer must tell them from the agent's own mistakes.
"""

from __future__ import annotations

import logging
import os
import subprocess
import weakref
from typing import TYPE_CHECKING, Any, Literal

from minisweagent.exceptions import Submitted
from minisweagent.utils.serialize import recursive_merge
from pydantic import BaseModel, ConfigDict, Field, SecretStr

import dsec

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"

# The interpreter and the command go to the sandbox unchanged, behind a /bin/sh that points the
# interpreter's stderr at its stdout: one pipe, so the two streams interleave in the order written, as
# with the real environments' stderr=STDOUT (two captured streams could only be concatenated).
_MERGE_STDERR = ["/bin/sh", "-c", 'exec "$@" 2>&1', "sh"]

# platform.uname()'s fields, which the real environments hand to the templates (the default ones use
# system, release, version and machine, with StrictUndefined); here read from the sandbox's own kernel.
_UNAME_FIELDS = ("system", "node", "release", "version", "machine", "processor")
_UNAME = "uname -s; uname -n; uname -r; uname -v; uname -m; uname -p"


class DsecEnvironmentConfig(BaseModel):
    """What ``DsecEnvironment(**kwargs)`` and a config's ``environment:`` section accept."""

    # A misspelt key, or a docker-only one (run_args, executable, container_timeout), is an error here:
    # ignored, it would silently drop a limit or a user the config asked for.
    model_config = ConfigDict(extra="forbid")

    image: str = "dsec/debian:12"
    """A dsec image: one the node has (a build, a snapshot) or a registry image (``python:3.11``)."""
    kind: str = "container"
    """The sandbox kind: ``container``, ``microvm``, ..."""
    cwd: str = "/"
    """Working directory of every command (created at start if missing, as ``docker run -w`` does)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables of every command."""
    forward_env: list[str] = Field(default_factory=list)
    """Variables of this process passed on to every command when set here (``env`` wins on a clash)."""
    timeout: int = 30
    """Seconds a command may run before it is killed with its process tree."""
    interpreter: list[str] = Field(default_factory=lambda: ["bash", "-lc"])
    """The command is appended to this, as in the docker environment."""
    user: str | None = None
    """Who runs the commands (a name or uid of the image); default: the image's runtime account."""
    output_limit: int | None = None
    """Bytes of output kept per command (head and tail); default: the daemon's (1 MiB)."""

    sandbox_timeout: float = 7200.0
    """The sandbox's time to live in seconds: the daemon reaps it after, whatever this process does."""
    cpu: float | None = None
    cpu_limit: float | None = None
    memory: int | str | None = None
    memory_request: int | str | None = None
    disk: int | str | None = None
    pids: int | None = None
    network: Literal["full"] | dict[str, list[str]] | None = None
    """None: loopback only; ``"full"``; or ``{"allow": ["pypi.org:443", ...]}``."""
    labels: dict[str, str] = Field(default_factory=dict)
    pull: Literal["if-not-present", "always"] = "if-not-present"
    wait_for_capacity: float = 600.0
    """Seconds to wait for a full node to admit the sandbox before raising ``dsec.Overloaded``."""
    trajectory: str | None = None
    """Bind the sandbox to a dsec trajectory id, so that a rerun replays the recorded calls."""

    url: str | None = None
    """The daemon; default: ``DSEC_URL``, else the local daemon."""
    token: SecretStr | None = Field(default=None, exclude=True, repr=False)
    """Default: ``DSEC_TOKEN``, else the local daemon's token. Never serialized into a trajectory."""


class DsecEnvironment:
    """mini-swe-agent's Environment protocol over one dsec sandbox."""

    def __init__(
        self,
        *,
        config_class: type[DsecEnvironmentConfig] = DsecEnvironmentConfig,
        logger: logging.Logger | None = None,
        **kwargs: Any,
    ) -> None:
        self.logger = logger or logging.getLogger("minisweagent.environment")
        self.config = config_class(**kwargs)
        self._platform: dict[str, str] | None = None
        token = self.config.token.get_secret_value() if self.config.token is not None else None
        self.client = dsec.Client(url=self.config.url, token=token)
        try:
            self.sandbox = self._create_sandbox()
        except BaseException:
            self.client.close()
            raise
        # Not only __del__: at interpreter exit objects may never be collected, while the SDK's loop
        # thread still runs during atexit; weakref.finalize kills the sandbox there, exactly once.
        self._finalizer = weakref.finalize(self, _release, self.sandbox, self.client, self.logger)
        self.logger.info("started dsec sandbox %s (%s, %s)", self.sandbox.id, self.sandbox.kind, self.config.image)
        try:
            self._make_cwd()
        except BaseException:
            self.cleanup()
            raise

    def _create_sandbox(self) -> dsec.Sandbox:
        c = self.config
        return dsec.Sandbox.create(
            c.image,
            c.kind,
            cpu=c.cpu,
            cpu_limit=c.cpu_limit,
            memory=c.memory,
            memory_request=c.memory_request,
            disk=c.disk,
            pids=c.pids,
            timeout=c.sandbox_timeout,
            labels={"harness": "mini-swe-agent", **c.labels},
            network=c.network,
            trajectory=c.trajectory,
            pull=c.pull,
            wait_for_capacity=c.wait_for_capacity,
            client=self.client,
        )

    def _make_cwd(self) -> None:
        if self.config.cwd in ("", "/"):
            return
        # as root, as `docker run -w` makes it, whoever runs the commands
        made = self.sandbox.exec(["mkdir", "-p", self.config.cwd], timeout=60, user="root")
        if made.exit_code != 0:
            raise ValueError(f"cannot create the working directory {self.config.cwd!r}: {made.stderr.strip()}")

    def execute(self, action: dict[str, Any], cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        """Run ``action["command"]``; raise ``Submitted`` when it printed the submission signal."""
        if not self._finalizer.alive:  # its client is closed too: say why rather than fail on the socket
            raise dsec.SandboxGone(f"sandbox {self.sandbox.id} is stopped: the environment was cleaned up")
        command = action.get("command", "")
        seconds = timeout or self.config.timeout
        try:
            result = self.sandbox.exec(
                [*_MERGE_STDERR, *self.config.interpreter, command],
                timeout=seconds,
                cwd=cwd or self.config.cwd or None,
                env=self._command_env(),
                user=self.config.user,
                output_limit=self.config.output_limit,
            )
        except dsec.DsecError:
            raise
        except Exception as e:  # what the real environments do with any other failure: show it to the model
            output = failure(e, "")
        else:
            output = observation(command, seconds, result)
        check_submitted(output)
        return output

    def _command_env(self) -> dict[str, str]:
        forwarded = {k: v for k in self.config.forward_env if (v := os.environ.get(k)) is not None}
        return forwarded | self.config.env

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return recursive_merge(self.config.model_dump(), self.platform(), kwargs)

    def platform(self) -> dict[str, str]:
        """``platform.uname()``'s fields as the sandbox sees them (read once)."""
        if self._platform is None:
            self._platform = self._read_uname()
        return self._platform

    def _read_uname(self) -> dict[str, str]:
        res = self.sandbox.exec(_UNAME, timeout=30)
        values = res.stdout.splitlines()
        if res.exit_code != 0 or len(values) != len(_UNAME_FIELDS):
            # every sandbox runs Linux; an image without uname must not break the templates
            self.logger.warning("uname failed in sandbox %s: %s", self.sandbox.id, (res.stdout + res.stderr)[-500:])
            values = ["Linux", "", "", "", "", ""]
        found = dict(zip(_UNAME_FIELDS, values, strict=True))
        if found["processor"] == "unknown":  # what platform.processor() makes of it too
            found["processor"] = ""
        return found

    def serialize(self) -> dict[str, Any]:
        cls = type(self)
        return {
            "info": {
                "config": {
                    "environment": self.config.model_dump(mode="json"),
                    "environment_type": f"{cls.__module__}.{cls.__qualname__}",
                },
                "dsec_sandbox": {"id": self.sandbox.id, "kind": self.sandbox.kind, "url": self.client.url},
            }
        }

    def cleanup(self) -> None:
        """Kill the sandbox (once; later calls do nothing)."""
        finalizer = getattr(self, "_finalizer", None)  # absent when __init__ failed before the sandbox ran
        if finalizer is not None:
            finalizer()

    def __del__(self) -> None:
        self.cleanup()

    def __enter__(self) -> DsecEnvironment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def observation(command: str, timeout: int, result: dsec.ExecResult) -> dict[str, Any]:
    """A command's result as the real environments report it."""
    output = result.stdout + result.stderr  # stderr is empty unless an interpreter reopens it
    if result.timed_out:
        # the real environments' report is subprocess's own TimeoutExpired, so the model reads the same words
        return failure(subprocess.TimeoutExpired(command, timeout), output)
    code = result.exit_code if result.exit_code is not None else 128 + (result.signal or 0)
    return {"output": output, "returncode": code, "exception_info": ""}


def failure(exc: BaseException, output: str) -> dict[str, Any]:
    return {
        "output": output,
        "returncode": -1,
        "exception_info": f"An error occurred while executing the command: {exc}",
        "extra": {"exception_type": type(exc).__name__, "exception": str(exc)},
    }


def check_submitted(output: dict[str, Any]) -> None:
    """Raise ``Submitted`` with the rest of the output when its first line is the submission signal.

    mini-swe-agent's agent loop ends only by this exception; its message is the exit message the real
    environments send (role ``exit``, the submission as content and in ``extra``).
    """
    lines = output.get("output", "").lstrip().splitlines(keepends=True)
    if output["returncode"] != 0 or not lines or lines[0].strip() != SUBMIT_MARKER:
        return
    submission = "".join(lines[1:])
    raise Submitted(
        {"role": "exit", "content": submission, "extra": {"exit_status": "Submitted", "submission": submission}}
    )


def _release(sandbox: dsec.Sandbox, client: dsec.Client, logger: logging.Logger) -> None:
    try:
        sandbox.kill()
    except Exception as e:  # e.g. the daemon is down: the sandbox's time to live ends it
        logger.warning("could not kill dsec sandbox %s: %s", sandbox.id, e)
    finally:
        try:
            client.close()
        except Exception as e:
            logger.debug("closing the dsec client: %s", e)


if TYPE_CHECKING:
    from minisweagent import Environment

    # mypy checks here that the class meets mini-swe-agent's protocol
    _protocol: type[Environment] = DsecEnvironment
