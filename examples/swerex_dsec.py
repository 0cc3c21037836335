"""SWE-ReX on dsec: a deployment whose machine is a dsec sandbox, driven as an agent harness drives it.

    pip install 'dsec[swerex]'
    DSEC_URL=unix:///var/lib/dsec/dsec.sock python examples/swerex_dsec.py   # or the local daemon's defaults

A harness that takes a SWE-ReX deployment object (SWE-agent's ``SWEEnv(deployment=...)``, say) takes
``DsecDeploymentConfig(...).get_deployment()`` the same way.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from swerex.exceptions import CommandTimeoutError
from swerex.runtime.abstract import (
    BashAction,
    BashInterruptAction,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
)

from dsec.integrations.swerex import DsecDeploymentConfig


async def main() -> None:
    deployment = DsecDeploymentConfig(image="dsec/debian:12", memory="1Gi", timeout=600).get_deployment()
    await deployment.start()
    try:
        runtime = deployment.runtime
        print("sandbox", deployment.sandbox_id)

        # a persistent shell: cd, exports and functions live on between actions
        await runtime.create_session(CreateBashSessionRequest())

        async def run(command: str, timeout: float | None = None) -> str:
            obs = await runtime.run_in_session(BashAction(command=command, check="silent", timeout=timeout))
            print(f"$ {command}\n{obs.output}[exit {obs.exit_code}]")
            return obs.output

        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "greet.py").write_text("def greet(name):\n    return 'hello ' + nam\n")
            (Path(tmp) / "test_greet.py").write_text("from greet import greet\nassert greet('x') == 'hello x'\n")
            await runtime.upload(UploadRequest(source_path=tmp, target_path="/work/project"))

        await run("cd /work/project && export PYTHONDONTWRITEBYTECODE=1")
        await run("python3 test_greet.py")  # fails: NameError
        await run("sed -i 's/+ nam$/+ name/' greet.py && python3 test_greet.py && echo passed")

        # a command that outlives its timeout raises SWE-ReX's error; an interrupt ends it
        try:
            await run("sleep 100", timeout=1)
        except CommandTimeoutError as e:
            print("timed out:", e)
        await runtime.run_in_session(BashInterruptAction())
        await run("pwd")  # still /work/project

        # one-off commands and files, outside the session
        print((await runtime.execute(Command(command=["python3", "--version"]))).stdout, end="")
        print((await runtime.read_file(ReadFileRequest(path="/work/project/greet.py"))).content, end="")
    finally:
        await deployment.stop()  # kills the sandbox


if __name__ == "__main__":
    asyncio.run(main())
