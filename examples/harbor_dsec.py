"""Harbor (the Terminal-Bench 2.0 harness) running a task in dsec sandboxes.

Harbor needs Python 3.12 or newer:

    python3.12 -m venv harbor-venv && harbor-venv/bin/pip install 'dsec[harbor]'
    DSEC_URL=unix:///var/lib/dsec/dsec.sock DSEC_TOKEN=... harbor-venv/bin/python examples/harbor_dsec.py

This writes a small task in Terminal-Bench's layout to a temporary directory and runs, for each of Harbor's
two reference agents,

    HARBOR_TELEMETRY=0 harbor run -p TASK -a oracle -e dsec.integrations.harbor:DsecEnvironment \\
        --jobs-dir JOBS -y

then prints the reward Harbor wrote to its jobs directory: the oracle (the task's own solution) scores 1.0,
the agent that does nothing 0.0. The first run builds the task's Dockerfile on the dsec node as
``harbor/count-lines:<hash>``; the second finds it there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

TASK_TOML = """\
schema_version = "1.4"

[agent]
timeout_sec = 120.0

[verifier]
timeout_sec = 120.0

[environment]
build_timeout_sec = 600.0
cpus = 1
memory_mb = 1024
network_mode = "no-network"
"""

DOCKERFILE = """\
FROM dsec/debian:12
WORKDIR /app
RUN seq 1 37 > /app/numbers.txt
"""

INSTRUCTION = "Count the lines of /app/numbers.txt and write the number to /app/count.txt.\n"

SOLVE = """\
#!/bin/bash
set -euo pipefail
wc -l < /app/numbers.txt > /app/count.txt
"""

TEST = """\
#!/bin/bash
if [ "$(tr -d ' ' < /app/count.txt 2>/dev/null)" = 37 ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
"""


def write_task(root: Path) -> Path:
    task = root / "count-lines"
    for rel, text in {
        "task.toml": TASK_TOML,
        "instruction.md": INSTRUCTION,
        "environment/Dockerfile": DOCKERFILE,
        "solution/solve.sh": SOLVE,
        "tests/test.sh": TEST,
    }.items():
        path = task / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if rel.endswith(".sh"):
            path.chmod(0o755)
    return task


def harbor() -> str:
    """The harbor command of this interpreter's environment, else the one on PATH."""
    beside = Path(sys.executable).parent / "harbor"
    return str(beside) if beside.exists() else "harbor"


def run(task: Path, agent: str, jobs: Path) -> float:
    argv = [harbor(), "run", "-p", str(task), "-a", agent, "-e", "dsec.integrations.harbor:DsecEnvironment"]
    argv += ["--jobs-dir", str(jobs), "--job-name", agent, "-y", "--quiet"]
    done = subprocess.run(argv, env={**os.environ, "HARBOR_TELEMETRY": "0"}, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"harbor run -a {agent} failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    (trial,) = (jobs / agent).glob("*/result.json")  # one task, one attempt: one trial
    result = json.loads(trial.read_text())
    if result["exception_info"] is not None:
        sys.exit(f"the {agent} trial failed: {result['exception_info']['exception_message']}")
    return float(result["verifier_result"]["rewards"]["reward"])


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="harbor-dsec-") as tmp:
        task = write_task(Path(tmp))
        for agent in ("oracle", "nop"):
            print(f"{agent}: {run(task, agent, Path(tmp) / 'jobs')}")


if __name__ == "__main__":
    main()
