"""mini-swe-agent's DefaultAgent with its commands in a dsec sandbox.

A scripted model (mini-swe-agent's DeterministicModel: no LLM, no API key) fixes a bug in a small git
repository made in the sandbox and submits ``git diff``; the script prints the submission. For a real
model, replace the DeterministicModel with ``minisweagent.models.get_model(...)``.

    pip install 'dsec[minisweagent]'
    python examples/minisweagent_dsec.py    # the daemon from DSEC_URL / DSEC_TOKEN, else the local one
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

# read by mini-swe-agent when first imported: no banner, and its config directory somewhere disposable
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
os.environ.setdefault("MSWEA_GLOBAL_CONFIG_DIR", str(Path(tempfile.gettempdir()) / "mswea-example"))

import yaml
from minisweagent import package_dir
from minisweagent.agents.default import DefaultAgent
from minisweagent.environments import get_environment
from minisweagent.models.test_models import DeterministicModel, make_output

from dsec.integrations.minisweagent import DsecEnvironment

TASK = {
    "calc.py": "def add(a, b):\n    return a - b\n",
    "test_calc.py": (
        "import unittest\n\nfrom calc import add\n\n\n"
        "class TestAdd(unittest.TestCase):\n    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n"
    ),
}
SCRIPT = [
    ("Let me read the module.", "cat calc.py"),
    ("Run its test.", "python3 -m unittest test_calc"),
    ("add subtracts: fix the operator, then test again.", "sed -i 's/a - b/a + b/' calc.py && python3 -m unittest"),
    ("The test passes. Submit the diff.", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git diff"),
]


def main() -> None:
    config = yaml.safe_load((Path(package_dir) / "config" / "default.yaml").read_text())
    # what a config file's `environment:` section would say
    env_config = {
        **config["environment"],
        "environment_class": "dsec.integrations.minisweagent.DsecEnvironment",
        "image": "dsec/debian:12",
        "cwd": "/repo",
        "timeout": 60,
    }
    env = get_environment(env_config)
    assert isinstance(env, DsecEnvironment)  # the task is set up through its dsec sandbox: env.sandbox
    try:
        for name, text in TASK.items():
            env.sandbox.files.write(f"/repo/{name}", text)
        env.sandbox.exec(
            "git init -q && git add -A && git -c user.name=me -c user.email=me@example.com commit -qm task", cwd="/repo"
        )

        outputs = [make_output(f"THOUGHT: {t}\n\n```mswea_bash_command\n{c}\n```", [{"command": c}]) for t, c in SCRIPT]
        model = DeterministicModel(outputs=outputs, observation_template=config["model"]["observation_template"])
        agent = DefaultAgent(model, env, **config["agent"])
        result = agent.run("calc.add(2, 3) returns -1 instead of 5. Fix it.")
    finally:
        env.cleanup()
    print(f"exit status: {result['exit_status']}")
    print(result["submission"], end="")


if __name__ == "__main__":
    main()
