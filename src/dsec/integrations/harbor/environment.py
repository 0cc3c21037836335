"""``DsecEnvironment``: Harbor's ``BaseEnvironment`` on one dsec sandbox per trial (and one per separate
verifier), reached through dsec's async SDK.

Harbor's Docker environment is the reference for what each call does: commands are ``bash -c`` command
lines (``sh -c`` on an image without bash) run as the image's user unless Harbor names one, in the task's
``workdir`` or else the image's WORKDIR; uploads copy a file or a directory's contents; downloads bring a
file or a directory's contents back. What differs is said where it happens: nothing is mounted from the
host (Harbor then copies /logs back, as it does for every remote environment), a command past its timeout
returns 124 instead of raising, and a task must be one container (a Dockerfile or a ``docker_image``).
"""

from __future__ import annotations

import asyncio
import inspect
import io
import stat
import tarfile
import weakref
from pathlib import Path
from typing import Any

try:
    from harbor.environments.base import BaseEnvironment, ExecResult, OutputCallback, transfer_tar_filter
except ModuleNotFoundError as e:  # pragma: no cover - the message is the point
    raise ModuleNotFoundError(
        "dsec.integrations.harbor needs Harbor 0.25 (Python 3.12 or newer): pip install 'dsec[harbor]'"
    ) from e
from harbor.environments.capabilities import EnvironmentCapabilities, EnvironmentResourceCapabilities
from harbor.environments.definition import (
    COMPOSE_FILE_NAME,
    DOCKERFILE_NAME,
    require_agent_environment_definition,
    should_use_prebuilt_docker_image,
)
from harbor.models.task.config import NetworkPolicy
from harbor.models.trial.config import ResourceMode

import dsec

from .mapping import MAX_EXEC, command_result, home_of, image_name, limits, network_spec
from .options import DsecOptions

# What Harbor itself passes to an environment's constructor; any other keyword is an --ek of ours or a mistake.
_HARBOR_ARGUMENTS = frozenset(inspect.signature(BaseEnvironment.__init__).parameters) - {"self", "args", "kwargs"}
# One build of a task's image at a time in this process: concurrent trials of one task wait for the first
# build and find its image, rather than building it as many times at once. (Per event loop: a lock
# belongs to the loop it first waited in.)
_BUILDS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Lock]] = weakref.WeakKeyDictionary()


def _build_lock(name: str) -> asyncio.Lock:
    locks = _BUILDS.setdefault(asyncio.get_running_loop(), {})
    return locks.setdefault(name, asyncio.Lock())


class DsecEnvironment(BaseEnvironment):  # type: ignore[misc]  # Harbor ships no type information
    """A Harbor environment in a dsec sandbox: ``harbor run -e dsec.integrations.harbor:DsecEnvironment``.

    The daemon is ``DSEC_URL`` with ``DSEC_TOKEN`` (else the local daemon); ``--ek`` sets dsec's own
    options (``DsecOptions``: kind, sandbox_timeout, pids, labels, output_limit, pull, wait_for_capacity).
    """

    def __init__(
        self,
        environment_dir: Path,
        environment_name: str,
        session_id: str,
        trial_paths: Any,
        task_env_config: Any,
        **kwargs: Any,
    ) -> None:
        ours = {key: kwargs.pop(key) for key in DsecOptions.model_fields if key in kwargs}
        unknown = sorted(set(kwargs) - _HARBOR_ARGUMENTS)
        if unknown:
            raise ValueError(
                f"DsecEnvironment has no option {', '.join(map(repr, unknown))}; "
                f"its --ek keys are {', '.join(DsecOptions.model_fields)}"
            )
        self.options = DsecOptions(**ours)
        self._client: dsec.AsyncClient | None = None
        self._sandbox: dsec.AsyncSandbox | None = None
        self._shell = "bash"
        self._passwd: str | None = None  # the sandbox's /etc/passwd, read at the first command as a named user
        super().__init__(
            environment_dir=environment_dir,
            environment_name=environment_name,
            session_id=session_id,
            trial_paths=trial_paths,
            task_env_config=task_env_config,
            **kwargs,
        )
        if self._host_mounts:
            raise ValueError(
                "a dsec sandbox mounts no host paths (--mounts): put data in the image, or upload it after start"
            )

    @staticmethod
    def type() -> str:
        return "dsec"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        # dsec's network policy: none (loopback only), everything but the host and other sandboxes, or an
        # allowlist of names and IPv4 addresses and networks; changed on the running sandbox between phases.
        # Wildcard names and IPv6 are not: Harbor refuses such tasks before anything starts.
        return EnvironmentCapabilities(
            disable_internet=True,
            network_allowlist=True,
            network_allowlist_hostnames=True,
            network_allowlist_ipv4_addresses=True,
            network_allowlist_ipv4_cidrs=True,
            dynamic_network_policy=True,
        )

    @classmethod
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities:
        return EnvironmentResourceCapabilities(
            cpu_limit=True, cpu_request=True, memory_limit=True, memory_request=True, fractional_cpus=True
        )

    @classmethod
    def preflight(cls) -> None:
        """Before any trial is queued: the daemon answers and takes the token."""
        client = dsec.Client()
        try:
            client.list(labels={"harness": "harbor"})
        except dsec.DsecError as e:
            raise SystemExit(
                f"dsec: the daemon at {client.url} refused or did not answer ({e}); "
                "set DSEC_URL and DSEC_TOKEN to a running daemon"
            ) from None
        finally:
            client.close()

    def _validate_definition(self) -> None:
        env_dir = self.environment_dir
        if (env_dir / COMPOSE_FILE_NAME).exists():
            raise ValueError(
                f"{env_dir / COMPOSE_FILE_NAME}: multi-container (Docker Compose) tasks are not supported by "
                "dsec; a task runs in one sandbox, from environment/Dockerfile or [environment].docker_image"
            )
        require_agent_environment_definition(env_dir, docker_image=self.task_env_config.docker_image)

    # ---- lifecycle ------------------------------------------------------------------------------------

    async def start(self, force_build: bool) -> None:
        """Build or pull the task's image, create the sandbox, make /logs/{agent,verifier,artifacts}."""
        if self._sandbox is not None:
            raise RuntimeError(f"the environment already runs (dsec sandbox {self._sandbox.id})")
        self._client = client = self._client or dsec.AsyncClient()
        image = await self._image(client, force_build)
        options = self.options
        self._sandbox = await dsec.AsyncSandbox.create(
            image,
            options.kind,
            timeout=options.sandbox_timeout,
            env=self._startup_env(),
            labels=self._labels(),
            network=network_spec(self.network_policy.network_mode.value, self.network_policy.allowed_hosts),
            pids=options.pids,
            pull=options.pull,
            wait_for_capacity=options.wait_for_capacity,
            client=client,
            **self._limits(),
        )
        self.logger.info("dsec sandbox %s runs %s (%s)", self._sandbox.id, image, options.kind)
        self._shell = await self._find_shell(self._sandbox)
        await self._prepare_dirs(self._sandbox)
        await self._upload_environment_dir_after_start()

    async def stop(self, delete: bool) -> None:
        """Kill the sandbox (``delete`` or not: a sandbox is not kept). The task's image stays on the node,
        where the next trial of the task finds it."""
        sandbox, client = self._sandbox, self._client
        self._sandbox = self._client = None
        try:
            if sandbox is not None:
                await sandbox.kill()
        except dsec.SandboxNotFound:
            pass
        except dsec.DsecError as e:  # e.g. the daemon went away: the sandbox's time to live ends it
            self.logger.warning("could not kill dsec sandbox %s: %s", sandbox.id if sandbox else "", e)
        finally:
            if client is not None:
                await client.aclose()

    @property
    def sandbox(self) -> dsec.AsyncSandbox:
        """The running sandbox; ``RuntimeError`` before ``start()`` and after ``stop()``."""
        if self._sandbox is None:
            raise RuntimeError("the dsec sandbox is not running: start the environment first")
        return self._sandbox

    def _labels(self) -> dict[str, str]:
        ours = {"harness": "harbor", "harbor.task": self.environment_name, "harbor.session": self.session_id}
        return {key: value[:512] for key, value in {**ours, **self.options.labels}.items()}

    def _limits(self) -> dict[str, Any]:
        auto = ResourceMode.LIMIT  # as Harbor's Docker environment: a task's cpus and memory_mb are ceilings
        return limits(
            cpu_request=self._resource_request_value("cpu", auto_mode=auto),
            cpu_limit=self._resource_limit_value("cpu", auto_mode=auto),
            memory_request_mb=self._resource_request_value("memory", auto_mode=auto),
            memory_limit_mb=self._resource_limit_value("memory", auto_mode=auto),
            storage_mb=self._effective_storage_mb,
        )

    async def _image(self, client: dsec.AsyncClient, force_build: bool) -> str:
        """The task's ``docker_image`` (pulled unless the node has it), or its Dockerfile built as
        ``harbor/<task>:<hash of environment/>`` (unless the node has that already and no rebuild is forced)."""
        config = self.task_env_config
        if should_use_prebuilt_docker_image(
            self.environment_dir, docker_image=config.docker_image, force_build=force_build
        ):
            reference = str(config.docker_image)
            await self._pull(client, reference)
            return reference
        name = image_name(self.environment_name, self.environment_id)
        async with _build_lock(name):
            if not force_build and await _has_image(client, name):
                self.logger.debug("dsec image %s is on the node", name)
                return name
            self.logger.info("building %s from %s", name, self.environment_dir / DOCKERFILE_NAME)
            built = await client.build_dockerfile(
                name, self.environment_dir, dockerfile=self.environment_dir / DOCKERFILE_NAME
            )
            cached = sum(1 for step in built.steps if step.cached)
            self.logger.info("built %s: %d layers (%d cached)", name, len(built.steps), cached)
        return name

    async def _pull(self, client: dsec.AsyncClient, reference: str) -> None:
        if self.options.pull == "if-not-present" and await _has_image(client, reference):
            return

        def progress(p: dsec.PullProgress) -> None:
            self.logger.debug("pull %s: %s, %d/%d layers", reference, p.phase, p.layers_done, p.layers)

        self.logger.info("pulling %s", reference)
        await client.pull(reference, policy=self.options.pull, on_progress=progress)

    async def _find_shell(self, sandbox: dsec.AsyncSandbox) -> str:
        """bash where the image has it (Harbor's commands are written for bash), else the image's /bin/sh."""
        found = await sandbox.exec(["/bin/sh", "-c", "command -v bash"], timeout=60)
        where = found.stdout.strip()
        if found.exit_code == 0 and where.startswith("/"):
            return where
        self.logger.warning("the image has no bash: commands run under /bin/sh")
        return "/bin/sh"

    async def _prepare_dirs(self, sandbox: dsec.AsyncSandbox) -> None:
        """The task's workdir (as ``docker run -w`` makes it: every command runs there) and the writable
        /logs directories Harbor copies back (the verifier's reward among them), open to every user."""
        workdir = self.task_env_config.workdir
        if workdir:
            made = await sandbox.exec(["mkdir", "-p", "--", workdir], timeout=60, user="root", cwd="/")
            if made.exit_code != 0:
                raise RuntimeError(f"cannot make the task's workdir {workdir}: {(made.stderr or made.stdout).strip()}")
        logs = await self.ensure_dirs(self._mount_targets(writable_only=True))
        if logs is not None and logs.return_code != 0:
            raise RuntimeError(f"cannot make Harbor's log directories: {(logs.stderr or logs.stdout or '').strip()}")

    # ---- network policy -------------------------------------------------------------------------------

    async def _apply_network_policy(self, network_policy: NetworkPolicy) -> None:
        policy = network_spec(network_policy.network_mode.value, network_policy.allowed_hosts)
        await self.sandbox.set_network(policy)

    # ---- commands -------------------------------------------------------------------------------------

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        """Run the command line under the image's bash (or sh), as Harbor's Docker environment does."""
        sandbox = self.sandbox
        who = self._resolve_user(user)
        account = None if who is None else str(who)
        seconds = min(float(timeout_sec), MAX_EXEC) if timeout_sec else MAX_EXEC
        args: dict[str, Any] = {
            "timeout": seconds,
            "cwd": cwd or self.task_env_config.workdir,
            "env": await self._env_for(sandbox, account, self._merge_env(env)),
            "user": account,
            "output_limit": self.options.output_limit,
        }
        argv = [self._shell, "-c", command]
        callback = self._output_callback()
        if callback is None:
            result = await sandbox.exec(argv, **args)
        else:
            result = await _streamed(sandbox, argv, args, callback)
        if result.truncated:
            self.logger.warning(
                "output of %r cut to its head and tail (%d bytes each)", command[:80], args["output_limit"]
            )
        out = command_result(result, timeout_sec)
        return ExecResult(stdout=out.stdout, stderr=out.stderr, return_code=out.return_code)

    async def _env_for(
        self, sandbox: dsec.AsyncSandbox, account: str | None, env: dict[str, str] | None
    ) -> dict[str, str] | None:
        """The command's environment, with HOME set to the named account's home (dsec's exec keeps the
        image account's HOME; ``docker exec -u`` sets the named one's, where agents install their tools)."""
        if account is None or (env and "HOME" in env):
            return env
        home = None if self._passwd is None else home_of(account, self._passwd)
        if home is None:  # read at the first named account, and again for one made since
            try:
                self._passwd = (await sandbox.files.read("/etc/passwd")).decode(errors="replace")
            except dsec.FileNotFoundInSandbox:
                self._passwd = ""
            home = home_of(account, self._passwd)
        return env if home is None else {**(env or {}), "HOME": home}

    # ---- files ----------------------------------------------------------------------------------------

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        """The file, with its mode, at ``target_path`` (its directory made if missing; into the directory
        when the target ends with a ``/``, as ``docker cp`` does)."""
        source = Path(source_path)
        if target_path.endswith("/"):
            target_path += source.name
        data = await asyncio.to_thread(source.read_bytes)
        mode = stat.S_IMODE((await asyncio.to_thread(source.stat)).st_mode)
        await self.sandbox.files.write(target_path, data, mode=mode)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        """The directory's contents into ``target_dir`` (made if missing), merged with what is there."""
        await self.sandbox.files.upload_dir(source_dir, target_dir)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        data = await self.sandbox.files.read(source_path)
        target = Path(target_path)
        await asyncio.to_thread(_write_local, target, data)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        """The directory's contents into ``target_dir``, overwriting files there; FIFOs and devices are
        skipped and links that leave the directory refused, as in Harbor's own tar transfers."""
        data = await self.sandbox.files.download_tar(source_dir)
        await asyncio.to_thread(_extract, data, Path(target_dir))


async def _has_image(client: dsec.AsyncClient, name: str) -> bool:
    try:
        await client.image(name)
    except dsec.ImageNotFound:
        return False
    return True


async def _streamed(
    sandbox: dsec.AsyncSandbox, argv: list[str], args: dict[str, Any], callback: OutputCallback
) -> dsec.ExecResult:
    """``exec`` with each chunk of output handed to Harbor's output callback as it comes."""
    result: dsec.ExecResult | None = None
    async for event in sandbox.exec_stream(argv, **args):
        if event.type in ("stdout", "stderr") and event.data:
            await callback(event.data, event.type)
        elif event.type == "result":
            result = event.result
    if result is None:
        raise dsec.BackendError("the command's output stream ended without its result")
    return result


def _write_local(target: Path, data: bytes) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)


def _extract(data: bytes, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(target, filter=transfer_tar_filter)
