"""``DsecDeployment``: a SWE-ReX deployment whose machine is a dsec sandbox, and its config.

``DsecDeploymentConfig`` is in the style of SWE-ReX's ``*DeploymentConfig`` classes. SWE-ReX has no
registry of deployment types, so its own ``DeploymentConfig`` union does not name this one: make the
deployment with ``DsecDeploymentConfig(...).get_deployment()``.

As SWE-ReX's own deployments do: before ``start()`` (and after ``stop()``) ``is_alive()`` answers not
alive and ``runtime`` raises ``DeploymentNotStartedError``; ``start()`` creates the sandbox and reports
its steps to the hooks; ``stop()`` closes the runtime's sessions and kills the sandbox.
"""

from __future__ import annotations

import logging
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator
from swerex.deployment.abstract import AbstractDeployment
from swerex.deployment.hooks.abstract import CombinedDeploymentHook, DeploymentHook
from swerex.exceptions import DeploymentNotStartedError, DeploymentStartupError
from swerex.runtime.abstract import IsAliveResponse
from swerex.utils.log import get_logger

from dsec import AsyncClient, AsyncSandbox, DsecError, SandboxNotFound

from .runtime import DsecRuntime

# Sandbox.create's own arguments, and what the deployment decides itself
_NOT_EXTRA = frozenset({"image", "kind", "cpu", "memory", "disk", "timeout", "env", "labels", "network", "client"})
_NOT_EXTRA |= {"wait_for_capacity", "trajectory"}


class DsecDeploymentConfig(BaseModel):
    """Configuration for running in a dsec sandbox (one per deployment, killed by ``stop()``)."""

    image: str = "dsec/debian:12"
    """The sandbox's image: a name the dsec node has, or a registry image it pulls. It needs bash."""
    kind: str = "container"
    """The dsec kind: container, microvm, vm."""
    cpu: float | None = None
    """CPU cores the node reserves for the sandbox (dsec's default when None)."""
    memory: int | str | None = None
    """Memory limit, e.g. "2Gi" (dsec's default when None)."""
    disk: int | str | None = None
    """Disk limit of the sandbox's writable layer, e.g. "10Gi" (dsec's default when None)."""
    timeout: float = 3600.0
    """The sandbox's time to live in seconds: the daemon kills it then, stopped or not."""
    env: dict[str, str] = {}
    """Environment of every command in the sandbox."""
    labels: dict[str, str] = {}
    """Labels of the sandbox (``dsec ps --label``), besides ``dsec.integration=swe-rex``."""
    network: str | dict[str, Any] | None = None
    """None (loopback only), "full", or {"allow": ["pypi.org:443", ...]}."""
    create_args: dict[str, Any] = {}
    """Any other argument of ``dsec.AsyncSandbox.create`` (cpu_limit, memory_request, pids, pull, volumes, ...)."""
    startup_timeout: float = 600.0
    """How long to wait for a full node to make room for the sandbox (``wait_for_capacity``)."""
    output_limit: int = 16 << 20
    """Bytes of each output stream ``execute()`` keeps (its head and tail beyond that)."""
    url: str | None = None
    """The dsec daemon (unix:///path or http(s)://host:port); default DSEC_URL, else the local daemon."""
    token: str | None = Field(default=None, repr=False)
    """The token; default DSEC_TOKEN, else the local daemon's."""

    type: Literal["dsec"] = "dsec"
    """Discriminator for (de)serialization/CLI. Do not change."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="after")
    def _create_args(self) -> DsecDeploymentConfig:
        taken = sorted(_NOT_EXTRA & set(self.create_args))
        if taken:
            raise ValueError(
                f"create_args may not set {', '.join(taken)}: they are fields of their own or not supported"
            )
        return self

    def sandbox_args(self) -> dict[str, Any]:
        """The keyword arguments of ``AsyncSandbox.create``."""
        return {
            "image": self.image,
            "kind": self.kind,
            "cpu": self.cpu,
            "memory": self.memory,
            "disk": self.disk,
            "timeout": self.timeout,
            "env": self.env,
            "labels": {"dsec.integration": "swe-rex", **self.labels},
            "network": self.network,
            "wait_for_capacity": self.startup_timeout,
            **self.create_args,
        }

    def get_deployment(self) -> DsecDeployment:
        return DsecDeployment.from_config(self)


class DsecDeployment(AbstractDeployment):
    def __init__(self, *, logger: logging.Logger | None = None, **kwargs: Any) -> None:
        """A deployment in a dsec sandbox; ``kwargs``: see ``DsecDeploymentConfig``."""
        self._config = DsecDeploymentConfig(**kwargs)
        self._runtime: DsecRuntime | None = None
        self.logger = logger or get_logger("rex-deploy")
        self._hooks = CombinedDeploymentHook()

    @classmethod
    def from_config(cls, config: DsecDeploymentConfig) -> Self:
        return cls(**config.model_dump())

    def add_hook(self, hook: DeploymentHook) -> None:
        self._hooks.add_hook(hook)

    @property
    def sandbox_id(self) -> str | None:
        """The dsec sandbox while the deployment runs."""
        return None if self._runtime is None else self._runtime.sandbox_id

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        if self._runtime is None:
            return IsAliveResponse(is_alive=False, message="the deployment has not been started")
        return await self._runtime.is_alive(timeout=timeout)

    async def start(self) -> None:
        """Creates the sandbox (waiting for room on a full node up to ``startup_timeout``)."""
        if self._runtime is not None:
            raise RuntimeError(f"the deployment already runs (sandbox {self._runtime.sandbox_id})")
        config = self._config
        self._hooks.on_custom_step("Starting dsec sandbox")
        self.logger.info("Starting dsec sandbox from %s (%s)", config.image, config.kind)
        try:
            async with AsyncClient(config.url, config.token) as client:
                sandbox = await AsyncSandbox.create(client=client, **config.sandbox_args())
        except DsecError as e:
            raise DeploymentStartupError(f"could not create a dsec sandbox from {config.image}: {e}") from e
        self._runtime = DsecRuntime(
            sandbox.id, url=config.url, token=config.token, output_limit=config.output_limit, logger=self.logger
        )
        self.logger.info("dsec sandbox %s is running", sandbox.id)

    async def stop(self) -> None:
        """Closes the sessions and kills the sandbox; stopping a deployment that does not run does nothing."""
        runtime = self._runtime
        if runtime is None:
            return
        await runtime.close()
        try:
            async with AsyncClient(self._config.url, self._config.token) as client:
                sandbox = await AsyncSandbox.connect(runtime.sandbox_id, client=client)
                await sandbox.kill()
        except SandboxNotFound:  # gone already (reaped long ago)
            pass
        # only now: a stop that failed (the daemon unreachable) can be tried again
        self._runtime = None
        self.logger.info("dsec sandbox %s stopped", runtime.sandbox_id)

    @property
    def runtime(self) -> DsecRuntime:
        """The runtime while the deployment runs; ``DeploymentNotStartedError`` otherwise."""
        if self._runtime is None:
            raise DeploymentNotStartedError()  # type: ignore[no-untyped-call]  # SWE-ReX's __init__ has no hints
        return self._runtime
