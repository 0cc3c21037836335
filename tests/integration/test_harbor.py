"""Harbor 0.25.0 (PyPI, unmodified; the Terminal-Bench 2.0 harness) runs tasks in dsec sandboxes through
``dsec.integrations.harbor:DsecEnvironment``: its own ``harbor run`` command line, offline, with its two
reference agents (oracle: the task's solution, scoring 1.0; nop: nothing, scoring 0.0), on Terminal-Bench-
format tasks written here: one built from its environment/Dockerfile, one from a ``docker_image`` pulled
from a registry, with a network policy that changes between the agent's and the verifier's phases. The
rewards are read from what Harbor wrote to its jobs directory; the sandboxes from the daemon.

Harbor needs Python 3.12: the tests make (or reuse) a 3.12 virtualenv with Harbor and this checkout's dsec
(harbor_venv.py), and run Harbor there against the suite's daemon.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import dsec

from .conftest import Daemon, scratch_dir
from .harbor_venv import ROOT, find_python312, harbor_venv
from .registry import Registry, start_registry

IMPORT_PATH = "dsec.integrations.harbor:DsecEnvironment"
# the first test makes the Harbor virtualenv (pip install of Harbor and its dependencies): minutes
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def venv(pytestconfig: pytest.Config) -> Path:
    # progress on the terminal while it happens, not only in a failure's captured output
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")

    def say(message: str) -> None:
        if reporter is None or capture is None:
            print(f"[harbor venv] {message}")
            return
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"[harbor venv] {message}")

    python, tried = find_python312()
    if python is None:
        reason = f"no Python 3.12 to install Harbor in (it needs >= 3.12); looked at: {', '.join(tried)}"
        say(reason)
        pytest.skip(reason)
    return harbor_venv(python, say)


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    with scratch_dir("dsec-harbor-") as path:
        yield path


@dataclass
class Job:
    result: dict[str, Any]  # jobs/NAME/result.json: the job's stats
    trials: list[dict[str, Any]]  # jobs/NAME/TRIAL/result.json, one per trial
    dir: Path
    output: str

    @property
    def trial(self) -> dict[str, Any]:
        (only,) = self.trials
        return only

    @property
    def trial_dir(self) -> Path:
        return self.dir / self.trial["trial_name"]

    @property
    def reward(self) -> float:
        assert self.trial["exception_info"] is None, self.trial["exception_info"]
        return float(self.trial["verifier_result"]["rewards"]["reward"])

    def mean(self, agent: str) -> float:
        stats = self.result["stats"]["evals"][f"{agent}__adhoc"]
        assert stats["n_errors"] == 0, stats
        return float(stats["metrics"][0]["mean"])


def harbor_env(daemon: Daemon, home: Path, **extra: str) -> dict[str, str]:
    # no PYTHONPATH of the suite's 3.11 interpreter: the venv's dsec is this checkout's (editable)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    home.mkdir(parents=True, exist_ok=True)  # Harbor keeps a cache in ~/.cache/harbor
    return env | {"HARBOR_TELEMETRY": "0", "DSEC_URL": daemon.url, "DSEC_TOKEN": daemon.token, "HOME": str(home)}


def harbor_run(venv: Path, daemon: Daemon, workdir: Path, task: Path, agent: str, name: str) -> Job:
    jobs = workdir / "jobs"
    argv = [str(venv / "bin" / "harbor"), "run", "-p", str(task), "-a", agent, "-e", IMPORT_PATH]
    argv += ["--jobs-dir", str(jobs), "--job-name", name, "-y", "-n", "1"]
    done = subprocess.run(
        argv,
        env=harbor_env(daemon, workdir / "home"),
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=900,
        stdin=subprocess.DEVNULL,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    trials = [json.loads(p.read_text()) for p in sorted((jobs / name).glob("*/result.json"))]
    return Job(json.loads((jobs / name / "result.json").read_text()), trials, jobs / name, output)


def write_task(root: Path, files: dict[str, str], task_toml: str) -> Path:
    root.mkdir(parents=True)
    (root / "task.toml").write_text(task_toml)
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if rel.endswith(".sh"):
            path.chmod(0o755)
    return root


def sandbox_of(daemon: Daemon, job: Job) -> dsec.SandboxInfo:
    """The trial's sandbox, by the session label the environment gave it."""
    session = f"{job.trial['trial_name']}__env"
    (info,) = daemon.client().list(labels={"harbor.session": session}, include_finished=True)
    return info


# ---- a task built from its Dockerfile ------------------------------------------------------------------

DOCKERFILE_TASK = """\
schema_version = "1.4"

[agent]
timeout_sec = 120.0

[verifier]
timeout_sec = 120.0

[environment]
build_timeout_sec = 900.0
cpus = 1
memory_mb = 1024
storage_mb = 2048
network_mode = "no-network"
"""


def dockerfile_task(root: Path) -> Path:
    # a fresh nonce: the first run must build the image, whatever an earlier test run left on the node
    nonce = secrets.token_hex(4)
    return write_task(
        root,
        {
            "instruction.md": "Write the line in /app/greeting.txt, upper-cased, to /app/answer.txt.\n",
            "environment/Dockerfile": (
                f"FROM dsec/debian:12\nWORKDIR /app\nRUN echo 'hello from the task image' > greeting.txt  # {nonce}\n"
            ),
            "solution/solve.sh": (
                "#!/bin/bash\nset -euo pipefail\ntr '[:lower:]' '[:upper:]' < greeting.txt > /app/answer.txt\n"
                'echo "solved in $(pwd) as $(id -u) under bash $BASH_VERSION"\n'
            ),
            "tests/test.sh": (
                "#!/bin/bash\n"
                'if [ "$(cat /app/answer.txt 2>/dev/null)" = "HELLO FROM THE TASK IMAGE" ]; then echo 1; '
                "else echo 0; fi > /logs/verifier/reward.txt\n"
            ),
        },
        DOCKERFILE_TASK,
    )


def test_the_oracle_scores_1_and_nop_0_on_a_task_built_from_its_dockerfile(
    venv: Path, daemon: Daemon, workdir: Path
) -> None:
    task = dockerfile_task(workdir / "greeting")
    oracle = harbor_run(venv, daemon, workdir, task, "oracle", "oracle")
    assert (oracle.reward, oracle.mean("oracle")) == (1.0, 1.0)
    assert (oracle.trial_dir / "verifier" / "reward.txt").read_text().strip() == "1"
    said = (oracle.trial_dir / "agent" / "oracle.txt").read_text()
    assert said.startswith("solved in /app as 0 under bash 5."), said  # the Dockerfile's WORKDIR, root, bash

    nop = harbor_run(venv, daemon, workdir, task, "nop", "nop")
    assert (nop.reward, nop.mean("nop")) == (0.0, 0.0)

    first, second = sandbox_of(daemon, oracle), sandbox_of(daemon, nop)
    assert first.id != second.id and first.state == second.state == "stopped"  # one per trial, gone after
    assert first.image == second.image and first.image.startswith("harbor/greeting:")
    assert daemon.client().image(first.image).name == first.image  # kept on the node for the next trial
    # built by the first run only: the second found it on the node
    assert f"building {first.image}" in (oracle.trial_dir / "trial.log").read_text()
    assert "building" not in (nop.trial_dir / "trial.log").read_text()
    # task.toml's resources and network mode, as Harbor's Docker environment takes them (ceilings)
    limits = first.limits
    assert (limits.cpu_limit, limits.memory, limits.disk) == (1.0, 1 << 30, 2 << 30)
    assert first.network is None  # no-network: loopback only
    assert first.labels["harness"] == "harbor" and first.labels["harbor.task"] == "greeting"


# ---- a task from a registry image ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def registry(workdir: Path) -> Iterator[Registry]:
    found = start_registry(workdir / "registry")
    try:
        yield found
    finally:
        found.stop()


def image_task(root: Path, image: str) -> Path:
    """A task without a Dockerfile: an image (busybox: no bash) and a file environment/ puts in the workdir.
    The agent runs without network, the verifier with the task's allowlist: each records what it sees."""
    toml = f"""\
schema_version = "1.4"

[agent]
timeout_sec = 120.0
network_mode = "no-network"

[verifier]
timeout_sec = 120.0

[environment]
docker_image = "{image}"
workdir = "/work"
network_mode = "allowlist"
allowed_hosts = ["example.com", "10.9.8.0/24"]
"""
    return write_task(
        root,
        {
            "instruction.md": "Multiply the numbers in /work/numbers.txt; write the product to /work/product.txt.\n",
            "environment/numbers.txt": "6 7\n",
            "solution/solve.sh": (
                "#!/bin/sh\nset -eu\nset -- $(cat numbers.txt)\necho $(($1 * $2)) > /work/product.txt\n"
                "ls /sys/class/net > /work/agent-net.txt\n"
            ),
            "tests/test.sh": (
                "#!/bin/sh\nls /sys/class/net > /logs/verifier/verifier-net.txt\n"
                "cp /work/agent-net.txt /logs/verifier/ 2>/dev/null\n"
                'if [ "$(cat /work/product.txt 2>/dev/null)" = 42 ]; then echo 1; else echo 0; fi'
                " > /logs/verifier/reward.txt\n"
            ),
        },
        toml,
    )


def test_a_docker_image_task_is_pulled_and_its_network_policy_follows_the_phases(
    venv: Path, daemon: Daemon, workdir: Path, registry: Registry
) -> None:
    reference = f"{registry.host}/harbor-test/busybox:{secrets.token_hex(4)}"
    daemon.client().push("dsec/busybox", reference)
    task = image_task(workdir / "product", reference)
    oracle = harbor_run(venv, daemon, workdir, task, "oracle", "image-oracle")
    assert oracle.reward == 1.0  # environment/numbers.txt reached the workdir; the solution ran under sh
    log = (oracle.trial_dir / "trial.log").read_text()
    assert f"pulling {reference}" in log and "no bash" in log
    verifier_dir = oracle.trial_dir / "verifier"
    # the agent's phase had no network (loopback only); the verifier's the task's allowlist (an interface)
    assert (verifier_dir / "agent-net.txt").read_text().split() == ["lo"]
    assert len((verifier_dir / "verifier-net.txt").read_text().split()) > 1

    info = sandbox_of(daemon, oracle)
    assert info.image == reference and info.state == "stopped"
    assert isinstance(info.network, dsec.NetworkAllow)
    assert info.network.allow == ["example.com:*", "10.9.8.0/24:*"]  # the baseline, restored after the agent

    nop = harbor_run(venv, daemon, workdir, task, "nop", "image-nop")
    assert nop.reward == 0.0
    assert "pulling" not in (nop.trial_dir / "trial.log").read_text()  # the node had it


# ---- the environment's calls, driven directly ----------------------------------------------------------


def test_commands_files_and_refusals_as_harbor_makes_them(venv: Path, daemon: Daemon, workdir: Path) -> None:
    """harbor_probe.py drives DsecEnvironment as the trial code does and reports; the judging is here."""
    work = workdir / "probe"
    work.mkdir()
    done = subprocess.run(
        [str(venv / "bin" / "python"), str(ROOT / "tests" / "integration" / "harbor_probe.py"), str(work)],
        env=harbor_env(daemon, workdir / "home"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-5000:]
    seen = json.loads(done.stdout)
    assert seen["type"] == "dsec" and seen["image"].startswith("harbor/probe:")
    assert seen["streams"] == ["out\n", "err\n", 3]
    assert seen["bash"] == ["bash\n", "", 0]
    assert seen["where"] == ["/work/task\nroot\n", "", 0]  # the task's workdir (made at start), the image's user
    assert seen["cwd"] == ["/tmp\n", "", 0]
    assert seen["as_root"] == ["root\n", "", 0]
    assert seen["default_user"] == ["agent\n/home/agent\n", "", 0]  # and that account's HOME, as docker exec -u
    assert seen["uid"] == ["1000\n", "", 0]
    # task env < persistent (job) env < per-call env < scoped env, as Harbor's _merge_env orders them
    assert seen["env"] == ["from the task|from the job|per call\n", "", 0]
    assert seen["scoped_env"] == ["scoped\n", "", 0]
    assert seen["signal"] == ["", "", 137]
    assert seen["timeout"] == ["started\n", "Command timed out after 2 seconds", 124]
    assert seen["timeout_seconds"] < 20 and seen["after_timeout"] == ["still here\n", "", 0]
    assert seen["streamed"] == ["a\n", "b\n", 0] and seen["chunks"] == [["stderr", "b\n"], ["stdout", "a\n"]]
    assert seen["logs"] == ["777 root\n755 root\n", "", 0]  # /logs/verifier open to every user
    uploaded = "./in/sub/run.sh\n./in/sub/top.txt\n./in/top.txt\n./one/run.sh\nran\n"  # modes kept: run.sh ran
    assert seen["uploaded"] == [uploaded, "", 0]
    assert seen["downloaded"] == ["down-one/x.txt", "down/deep/f.txt"]  # the FIFO skipped
    assert seen["is_dir"] == [True, False, True]
    assert seen["state"] == "stopped" and "not running" in seen["after_stop"]
    assert "no option 'no_such_option'" in seen["unknown_option"] and "sandbox_timeout" in seen["bad_option"]
    assert "mounts no host paths" in seen["host_mount"] and "Docker Compose" in seen["compose"]


def test_harbor_stops_before_any_trial_when_the_daemon_cannot_be_reached(
    venv: Path, daemon: Daemon, workdir: Path
) -> None:
    task = dockerfile_task(workdir / "unreached")
    env = harbor_env(daemon, workdir / "home") | {"DSEC_URL": f"unix://{workdir}/no-daemon.sock"}
    argv = [str(venv / "bin" / "harbor"), "run", "-p", str(task), "-a", "nop", "-e", IMPORT_PATH]
    argv += ["--jobs-dir", str(workdir / "jobs"), "--job-name", "unreached", "-y"]
    done = subprocess.run(argv, env=env, cwd=workdir, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert f"dsec: the daemon at unix://{workdir}/no-daemon.sock refused or did not answer" in done.stdout + done.stderr
    assert not (workdir / "jobs" / "unreached").exists()


def test_the_example_script_scores_the_oracle_and_nop(venv: Path, daemon: Daemon, workdir: Path) -> None:
    done = subprocess.run(
        [str(venv / "bin" / "python"), str(ROOT / "examples" / "harbor_dsec.py")],
        env=harbor_env(daemon, workdir / "home"),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.splitlines() == ["oracle: 1.0", "nop: 0.0"]
