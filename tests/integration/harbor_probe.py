"""Run inside the Harbor virtualenv (Python 3.12) by test_harbor.py: drives ``DsecEnvironment`` as Harbor's
trial code does (constructor, start, exec, file transfers, stop) and prints what it saw as one JSON
object, which the test, on the suite's Python, checks. Nothing is judged here.

    python harbor_probe.py WORKDIR
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from harbor.environments.base import ExecResult
from harbor.models.task.config import EnvironmentConfig
from harbor.models.trial.paths import TrialPaths

import dsec
from dsec.integrations.harbor import DsecEnvironment


def result(r: ExecResult) -> list[Any]:
    return [r.stdout, r.stderr, r.return_code]


def make(work: Path, name: str, **kwargs: Any) -> DsecEnvironment:
    env_dir = work / name / "environment"
    env_dir.mkdir(parents=True, exist_ok=True)
    (env_dir / "Dockerfile").write_text("FROM dsec/debian:12\nWORKDIR /srv\nRUN useradd -m agent\n")
    config = kwargs.pop("config", None) or EnvironmentConfig(workdir="/work/task", env={"TASK_VAR": "from the task"})
    return DsecEnvironment(
        environment_dir=env_dir,
        environment_name=name,
        session_id=f"{name}__probe__env",
        trial_paths=TrialPaths(work / name / "trial"),
        task_env_config=config,
        auto_mounts=[{"type": "bind", "source": str(work), "target": "/logs/verifier"}],
        **kwargs,
    )


async def commands(env: DsecEnvironment, seen: dict[str, Any]) -> None:
    seen["streams"] = result(await env.exec("echo out; echo err >&2; exit 3"))
    seen["bash"] = result(await env.exec("[[ -n $BASH_VERSION ]] && echo bash"))
    seen["where"] = result(await env.exec("pwd; id -un"))
    seen["cwd"] = result(await env.exec("pwd", cwd="/tmp"))
    seen["as_root"] = result(await env.exec("id -un", user="root"))
    with env.with_default_user("agent"):
        seen["default_user"] = result(await env.exec("id -un; echo $HOME"))
    seen["uid"] = result(await env.exec("id -u", user=1000))
    seen["env"] = result(await env.exec('echo "$TASK_VAR|$JOB_VAR|$CALL_VAR"', env={"CALL_VAR": "per call"}))
    with env.scoped_exec_env({"JOB_VAR": "scoped"}):
        seen["scoped_env"] = result(await env.exec('echo "$JOB_VAR"', env={"JOB_VAR": "per call"}))
    seen["signal"] = result(await env.exec("kill -9 $$"))
    started = time.monotonic()
    seen["timeout"] = result(await env.exec("echo started; sleep 60; echo never", timeout_sec=2))
    seen["timeout_seconds"] = time.monotonic() - started
    seen["after_timeout"] = result(await env.exec("echo still here"))
    chunks: list[list[str]] = []

    async def collect(text: str, stream: str) -> None:
        chunks.append([stream, text])

    with env.scoped_output_callback(collect):
        seen["streamed"] = result(await env.exec("echo a; echo b >&2"))
    seen["chunks"] = sorted(chunks)
    seen["logs"] = result(await env.exec("stat -c '%a %U' /logs/verifier /work/task"))


async def files(env: DsecEnvironment, work: Path, seen: dict[str, Any]) -> None:
    local = work / "upload"
    (local / "sub").mkdir(parents=True)
    (local / "top.txt").write_text("top\n")
    (local / "sub" / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (local / "sub" / "run.sh").chmod(0o755)
    await env.upload_dir(local, "/data/in")
    await env.upload_file(local / "sub" / "run.sh", "/data/one/run.sh")
    await env.upload_file(local / "top.txt", "/data/in/sub/")
    seen["uploaded"] = result(await env.exec("cd /data && find . -type f | sort && /data/one/run.sh"))
    made = "mkdir -p /data/out/deep && echo deep > /data/out/deep/f.txt && mkfifo /data/out/pipe && echo x > /data/x"
    seen["made"] = result(await env.exec(made))
    await env.download_dir("/data/out", work / "down")
    await env.download_file("/data/x", work / "down-one" / "x.txt")
    seen["downloaded"] = await asyncio.to_thread(listing, work)
    seen["is_dir"] = [await env.is_dir("/data/out"), await env.is_dir("/data/x"), await env.is_file("/data/x")]


def listing(work: Path) -> list[str]:
    return sorted(str(p.relative_to(work)) for p in work.glob("down*/**/*") if p.is_file())


async def probe(work: Path) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    env = make(work, "probe", persistent_env={"JOB_VAR": "from the job"}, labels={"case": "harbor-probe"})
    seen["type"] = env.type()
    await env.start(force_build=False)
    seen["sandbox"] = env.sandbox.id
    seen["image"] = (await env.sandbox.info()).image
    try:
        await commands(env, seen)
        await files(env, work, seen)
    finally:
        await env.stop(delete=True)
    try:
        env.sandbox  # noqa: B018
    except RuntimeError as e:
        seen["after_stop"] = str(e)
    async with dsec.AsyncClient() as client:
        seen["state"] = (await (await dsec.AsyncSandbox.connect(seen["sandbox"], client=client)).info()).state
    refusals(work, seen)
    return seen


def refusals(work: Path, seen: dict[str, Any]) -> None:
    """What the constructor refuses before anything is made."""
    for case, kwargs in {
        "unknown_option": {"no_such_option": 1},
        "bad_option": {"sandbox_timeout": -1},
        "host_mount": {"mounts": [{"type": "bind", "source": "/etc", "target": "/host-etc"}]},
    }.items():
        try:
            make(work, case, **kwargs)
            seen[case] = None
        except (ValueError, RuntimeError) as e:
            seen[case] = str(e)
    compose = work / "compose" / "environment"
    compose.mkdir(parents=True)
    (compose / "docker-compose.yaml").write_text("services: {}\n")
    try:
        make(work, "compose")
        seen["compose"] = None
    except ValueError as e:
        seen["compose"] = str(e)


if __name__ == "__main__":
    assert os.environ.get("DSEC_URL"), "the test names the daemon"
    print(json.dumps(asyncio.run(probe(Path(sys.argv[1])))))
