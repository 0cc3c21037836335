"""mini-swe-agent 2.4.6 (PyPI, unmodified) runs its own DefaultAgent in dsec sandboxes through
``dsec.integrations.minisweagent.DsecEnvironment``: a scripted model (mini-swe-agent's DeterministicModel,
no LLM) fixes a bug in a git repository inside a sandbox and submits ``git diff`` through the submission
signal; the reward is the repository's test run on that diff in a fresh sandbox. Commands are compared
with mini-swe-agent's own LocalEnvironment running the same ones on this host."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

import dsec

from .conftest import Daemon

# read by mini-swe-agent when first imported: no banner, and no config directory in the user's home
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
os.environ.setdefault("MSWEA_GLOBAL_CONFIG_DIR", str(Path(tempfile.gettempdir()) / "dsec-tests-mswea"))

pytest.importorskip("minisweagent")
from minisweagent import package_dir
from minisweagent.agents.default import DefaultAgent
from minisweagent.environments import get_environment
from minisweagent.environments.local import LocalEnvironment
from minisweagent.exceptions import Submitted
from minisweagent.models.test_models import DeterministicModel, make_output

from dsec.integrations.minisweagent import DsecEnvironment

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "dsec/debian:12"
CLASS = "dsec.integrations.minisweagent.DsecEnvironment"
REPO = "/repo"
CALC = "def add(a, b):\n    return a - b\n"
TEST = (
    "import unittest\n\nfrom calc import add\n\n\n"
    "class TestAdd(unittest.TestCase):\n    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n"
)
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git diff"


def default_config() -> dict[str, Any]:
    """mini-swe-agent's own default config (the agent's templates, the model's observation template)."""
    config: dict[str, Any] = yaml.safe_load((Path(package_dir) / "config" / "default.yaml").read_text())
    return config


def make_repo(sb: dsec.Sandbox) -> None:
    """The task: a module whose test fails, committed."""
    sb.exec(["mkdir", "-p", REPO])
    sb.files.write(f"{REPO}/calc.py", CALC)
    sb.files.write(f"{REPO}/test_calc.py", TEST)
    made = sb.exec(
        "git init -q && git add -A && git -c user.name=t -c user.email=t@example.com commit -qm task", cwd=REPO
    )
    assert made.exit_code == 0, made


def reward(client: dsec.Client, diff: str) -> float:
    """1.0 when the repository's test passes with ``diff`` applied to a fresh copy of the task, else 0.0."""
    with dsec.Sandbox.create(image=IMAGE, timeout=300, client=client) as sb:
        make_repo(sb)
        sb.files.write("/tmp/fix.patch", diff)
        if sb.exec("git apply /tmp/fix.patch", cwd=REPO).exit_code != 0:
            return 0.0
        return 1.0 if sb.exec("python3 -m unittest test_calc", cwd=REPO).exit_code == 0 else 0.0


def step(thought: str, command: str) -> dict[str, Any]:
    """One scripted model turn, written as the default config's format asks a model to write it."""
    return make_output(f"THOUGHT: {thought}\n\n```mswea_bash_command\n{command}\n```", [{"command": command}])


def state(daemon: Daemon, sandbox_id: str) -> str:
    return str(dsec.Sandbox.connect(sandbox_id, client=daemon.client()).info().state.value)


@pytest.mark.parametrize(
    ("fix", "expected"),
    [("sed -i 's/a - b/a + b/' calc.py", 1.0), ("sed -i 's/a - b/a * b/' calc.py", 0.0)],
    ids=["right-fix", "wrong-fix"],
)
def test_the_default_agent_fixes_a_bug_in_a_sandbox_and_submits_its_diff(
    daemon: Daemon, fix: str, expected: float
) -> None:
    config = default_config()
    env = DsecEnvironment(image=IMAGE, cwd=REPO, timeout=60, **config["environment"])
    try:
        make_repo(env.sandbox)
        model = DeterministicModel(
            outputs=[
                step("Read the module.", "cat calc.py"),
                step("Run its test.", "python3 -m unittest test_calc"),
                step("Fix the operator.", fix),
                step("Submit the change.", SUBMIT),
            ],
            observation_template=config["model"]["observation_template"],
        )
        agent = DefaultAgent(model, env, **config["agent"])
        result = agent.run("calc.add(2, 3) returns -1 instead of 5. Fix it.")
        sandbox_id = env.sandbox.id
    finally:
        env.cleanup()

    assert result["exit_status"] == "Submitted"
    diff = result["submission"]
    assert diff.startswith("diff --git a/calc.py b/calc.py\n")
    new_line = "+    return a + b\n" if expected else "+    return a * b\n"
    assert "-    return a - b\n" + new_line in diff
    assert reward(daemon.client(), diff) == expected
    assert state(daemon, sandbox_id) == "stopped"

    observations = [m["content"] for m in agent.messages if m["role"] == "user"][1:]
    assert "<returncode>0</returncode>" in observations[0] and "return a - b" in observations[0]
    # unittest reports on stderr: merged into the one output the model reads
    assert "<returncode>1</returncode>" in observations[1] and "AssertionError: -1 != 5" in observations[1]
    assert agent.messages[-1]["role"] == "exit" and agent.messages[-1]["content"] == diff

    # the task prompt names the sandbox's kernel, read in the sandbox (the default templates need it)
    probe = dsec.Sandbox.create(image=IMAGE, timeout=60, client=daemon.client())
    with probe:
        uname = probe.exec("echo $(uname -s) $(uname -r) $(uname -v) $(uname -m)").stdout.strip()
    assert f"<system_information>\n{uname}\n</system_information>" in agent.messages[1]["content"]

    saved = agent.serialize()
    assert saved["info"]["config"]["environment_type"] == CLASS
    assert saved["info"]["config"]["environment"]["cwd"] == REPO
    assert saved["info"]["dsec_sandbox"]["id"] == sandbox_id


def test_get_environment_selects_it_by_its_dotted_path(daemon: Daemon) -> None:
    env = get_environment(
        {
            "environment_class": CLASS,
            "image": IMAGE,
            "url": daemon.url,
            "token": daemon.token,
            "cwd": "/work/task",  # not in the image: made, as docker run -w makes it
            "env": {"GREETING": "hello"},
            "labels": {"case": "get-environment"},
        }
    )
    assert isinstance(env, DsecEnvironment)
    try:
        out = env.execute({"command": "pwd; echo $GREETING; id -u"})
        assert out == {"output": "/work/task\nhello\n0\n", "returncode": 0, "exception_info": ""}
        assert env.execute({"command": "pwd"}, cwd="/tmp")["output"] == "/tmp\n"

        info = dsec.Sandbox.connect(env.sandbox.id, client=daemon.client()).info()
        assert info.image == IMAGE and info.labels == {"harness": "mini-swe-agent", "case": "get-environment"}

        uname = env.sandbox.exec("uname -s; uname -r; uname -v; uname -m").stdout.splitlines()
        tv = env.get_template_vars(task="the task")
        assert [tv["system"], tv["release"], tv["version"], tv["machine"]] == uname
        assert tv["image"] == IMAGE and tv["cwd"] == "/work/task" and tv["task"] == "the task"
        assert "token" not in tv

        saved = json.dumps(env.serialize())
        assert daemon.token not in saved
        assert env.serialize()["info"]["config"]["environment_type"] == CLASS
    finally:
        env.cleanup()


def test_forwarded_variables_the_user_and_the_interpreter_are_the_configs(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MSWEA_TEST_FORWARDED", "from the host")
    monkeypatch.setenv("MSWEA_TEST_CLASH", "host")
    monkeypatch.delenv("MSWEA_TEST_ABSENT", raising=False)
    forward = ["MSWEA_TEST_FORWARDED", "MSWEA_TEST_CLASH", "MSWEA_TEST_ABSENT"]
    config = {"user": "nobody", "interpreter": ["python3", "-c"], "forward_env": forward}
    with DsecEnvironment(image=IMAGE, cwd="/work/task", env={"MSWEA_TEST_CLASH": "config"}, **config) as env:
        out = env.execute(
            {
                "command": "import os, sys; e = os.environ; "
                "print(os.getuid(), os.getcwd(), e['MSWEA_TEST_FORWARDED'], e['MSWEA_TEST_CLASH'], "
                "'MSWEA_TEST_ABSENT' in e, flush=True); print('to stderr', file=sys.stderr); sys.exit(4)"
            }
        )
    assert out == {
        "output": "65534 /work/task from the host config False\nto stderr\n",
        "returncode": 4,
        "exception_info": "",
    }


def test_a_sandbox_that_died_under_the_agent_raises_rather_than_answering_the_model(daemon: Daemon) -> None:
    with DsecEnvironment(image=IMAGE) as env:
        dsec.Sandbox.connect(env.sandbox.id, client=daemon.client()).kill()  # e.g. its time to live ran out
        with pytest.raises(dsec.SandboxGone, match="stopped"):
            env.execute({"command": "true"})


def test_a_dsec_trajectory_replays_the_commands_of_a_rerun(daemon: Daemon) -> None:
    """With ``trajectory``, a rerun of the same rollout is answered from dsec's log of the first."""
    outputs = []
    for _ in range(2):
        with DsecEnvironment(image=IMAGE, cwd="/work", trajectory="mswea-test/rollout-1") as env:
            first = env.execute({"command": "head -c 8 /dev/urandom | od -An -tx1 | tr -d ' \\n'"})
            second = env.execute({"command": "echo $((6 * 7))"})
            outputs.append((first["output"], second["output"], env.get_template_vars()["release"]))
    assert outputs[0] == outputs[1] and len(outputs[0][0]) == 16 and outputs[0][1] == "42\n"
    assert daemon.client().trajectory("mswea-test/rollout-1").length >= 4


def test_a_config_key_it_does_not_know_is_refused_before_any_sandbox_exists(daemon: Daemon) -> None:
    before = {s.id for s in daemon.client().list()}
    # a docker environment's setting: ignored, it would silently drop the limits the config asked for
    with pytest.raises(ValueError, match="run_args"):
        get_environment({"environment_class": CLASS, "run_args": ["--memory", "1g"]})
    assert {s.id for s in daemon.client().list()} == before


def test_a_missing_image_is_a_clear_error_at_once(daemon: Daemon) -> None:
    started = time.monotonic()
    with pytest.raises(dsec.ImageNotFound, match="dsec/no-such-image:1"):
        get_environment({"environment_class": CLASS, "image": "dsec/no-such-image:1"})
    assert time.monotonic() - started < 30


def _both(command: str, timeout: int | None = None) -> tuple[Any, Any]:
    """What mini-swe-agent's LocalEnvironment (on this host) and DsecEnvironment make of one command."""
    outcomes = []
    local = LocalEnvironment(cwd=tempfile.gettempdir())
    with DsecEnvironment(image=IMAGE, cwd="/tmp") as remote:
        for env in (local, remote):
            try:
                outcomes.append(env.execute({"command": command}, timeout=timeout))
            except Submitted as e:
                outcomes.append(("Submitted", e.messages))
    return outcomes[0], outcomes[1]


@pytest.mark.parametrize(
    "command",
    [
        "echo out; echo err >&2; echo out2; exit 3",
        "printf 'no newline'; printf ' err' >&2",
        "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo line1; echo line2 >&2",
        "  echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo not submitted; exit 1",
        "echo first; echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT",
    ],
    ids=["streams-merged", "no-newline", "submitted", "failed-submission", "marker-not-first"],
)
def test_commands_come_back_as_from_the_local_environment(daemon: Daemon, command: str) -> None:
    local, remote = _both(command)
    assert remote == local


def test_a_command_timeout_is_reported_as_the_local_environment_reports_it(daemon: Daemon) -> None:
    command = "echo started; sleep 30; echo never"
    started = time.monotonic()
    local, remote = _both(command, timeout=2)
    assert time.monotonic() - started < 20
    assert remote == local
    assert remote["returncode"] == -1 and remote["output"] == "started\n"
    assert remote["exception_info"] == (
        f"An error occurred while executing the command: Command '{command}' timed out after 2 seconds"
    )
    assert remote["extra"]["exception_type"] == "TimeoutExpired"


def test_the_config_timeout_applies_and_the_sandbox_goes_on_after_it(daemon: Daemon) -> None:
    with DsecEnvironment(image=IMAGE, timeout=1) as env:
        started = time.monotonic()
        out = env.execute({"command": "sleep 30"})
        assert time.monotonic() - started < 15
        assert out["returncode"] == -1 and "timed out after 1 seconds" in out["exception_info"]
        assert env.execute({"command": "echo still here"})["output"] == "still here\n"


def test_the_sandbox_is_gone_after_cleanup_the_with_block_or_collection(daemon: Daemon) -> None:
    env = DsecEnvironment(image=IMAGE)
    first = env.sandbox.id
    assert state(daemon, first) == "running"
    env.cleanup()
    env.cleanup()  # a second time does nothing
    assert state(daemon, first) == "stopped"
    with pytest.raises(dsec.SandboxGone, match="cleaned up"):  # raised, not shown to the model
        env.execute({"command": "true"})

    with DsecEnvironment(image=IMAGE) as env:
        second = env.sandbox.id
    assert state(daemon, second) == "stopped"

    env = DsecEnvironment(image=IMAGE)
    third = env.sandbox.id
    del env
    gc.collect()
    assert state(daemon, third) == "stopped"


def test_the_mini_command_line_selects_it_and_the_sandbox_ends_with_the_process(daemon: Daemon, tmp_path: Path) -> None:
    """mini-swe-agent's own `mini`, with --environment-class; it never calls cleanup(), so the sandbox
    must go at interpreter exit."""
    script = [
        ("Write the file.", "echo hi > f.txt && uname -s"),
        ("Submit.", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat f.txt"),
    ]
    config = {
        "model": {"outputs": [step(thought, command) for thought, command in script]},
        "environment": {"image": IMAGE, "cwd": "/work", "labels": {"case": "mini-cli"}},
    }
    (tmp_path / "scripted.yaml").write_text(yaml.safe_dump(config))
    trajectory = tmp_path / "run.traj.json"
    argv = [str(Path(sys.executable).parent / "mini"), "-c", "mini.yaml", "-c", str(tmp_path / "scripted.yaml")]
    argv += ["--model-class", "deterministic", "-m", "scripted", "--environment-class", CLASS]
    argv += ["-t", "write hi to f.txt", "--yolo", "--exit-immediately", "-o", str(trajectory)]
    env = os.environ | {"DSEC_URL": daemon.url, "DSEC_TOKEN": daemon.token, "MSWEA_CONFIGURED": "1"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    info = json.loads(trajectory.read_text())["info"]
    assert (info["exit_status"], info["submission"]) == ("Submitted", "hi\n")
    assert info["config"]["environment_type"] == CLASS and info["config"]["environment"]["cwd"] == "/work"
    assert daemon.token not in trajectory.read_text()
    sandbox_id = info["dsec_sandbox"]["id"]
    assert [s.id for s in daemon.client().list(labels={"case": "mini-cli"})] == []  # none left running
    assert state(daemon, sandbox_id) == "stopped"


def test_the_example_script_prints_the_submission(daemon: Daemon) -> None:
    env = os.environ | {"DSEC_URL": daemon.url, "DSEC_TOKEN": daemon.token}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "minisweagent_dsec.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "exit status: Submitted" in done.stdout
    assert "-    return a - b\n+    return a + b\n" in done.stdout
