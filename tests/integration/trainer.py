"""A trainer as a user writes it, with nothing for resuming: create the sandbox with a trajectory id,
run the rollout's steps, compute a reward. Run it again after it was killed and it carries on.

    python trainer.py TRAJECTORY KIND OUT [full|light]

Each step's observed result is appended to OUT as one JSON line (what the trainer "saw"), then the
reward. Several steps are not idempotent (appends, git commits): run twice, they would change the
outcome. Git dates are fixed so that commit ids are the same in every run. ``light`` runs shell steps
on dsec/busybox (for VM kinds under TCG, where git and python cost seconds a step).
"""

from __future__ import annotations

import json
import sys

import dsec

GIT_ENV = {
    "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z",
    "GIT_AUTHOR_NAME": "trainer",
    "GIT_AUTHOR_EMAIL": "t@example.com",
    "GIT_COMMITTER_NAME": "trainer",
    "GIT_COMMITTER_EMAIL": "t@example.com",
}

STEPS: list[tuple[str, ...]] = [
    ("exec", "mkdir -p /work && cd /work && git init -q -b main && echo ok"),
    ("exec", "echo x >> /work/f; wc -l < /work/f"),
    ("write", "/work/solution.py", "def add(a, b):\n    return a - b\n"),
    ("exec", "cd /work && git add -A && git commit -qm first && git rev-list --count HEAD"),
    ("exec", "echo x >> /work/f; wc -l < /work/f"),
    ("read", "/work/solution.py"),
    ("write", "/work/solution.py", "def add(a, b):\n    return a + b\n"),
    ("exec", "cd /work && git commit -qam fix && git rev-list --count HEAD && git rev-parse HEAD"),
    ("exec", "cd /work && python3 -c 'from solution import add; print(add(2, 3))'"),
    ("exec", "echo x >> /work/f; wc -l < /work/f; rm -f /work/gone; seq 3 > /work/gone; ls /work"),
    ("exec", "cd /work && git log --format='%H %s' && wc -l < f"),
]


LIGHT: list[tuple[str, ...]] = [
    ("exec", "mkdir -p /work && echo ok"),
    ("exec", "echo x >> /work/f; wc -l < /work/f"),
    ("write", "/work/answer.sh", "echo $((2 - 3))\n"),
    ("exec", "sh /work/answer.sh"),
    ("exec", "echo x >> /work/f; wc -l < /work/f"),
    ("read", "/work/answer.sh"),
    ("write", "/work/answer.sh", "echo $((2 + 3))\n"),
    ("exec", "mv /work/f /work/g && wc -l < /work/g"),
    ("exec", "echo x >> /work/g; wc -l < /work/g; ls /work"),
]
PROFILES = {
    "full": ("dsec/debian:12", STEPS, "cd /work && python3 -c 'from solution import add; print(add(2, 3))'"),
    "light": ("dsec/busybox", LIGHT, "sh /work/answer.sh"),
}


def main() -> None:
    trajectory, kind, out = sys.argv[1], sys.argv[2], sys.argv[3]
    image, steps, check = PROFILES[sys.argv[4] if len(sys.argv) > 4 else "full"]
    sb = dsec.Sandbox.create(image, kind, trajectory=trajectory, timeout=900, env=GIT_ENV)
    with open(out, "a", encoding="utf-8") as f:
        for i, step in enumerate(steps):
            if step[0] == "exec":
                r = sb.exec(step[1], timeout=120)
                seen: object = {"exit": r.exit_code, "stdout": r.stdout, "stderr": r.stderr}
            elif step[0] == "write":
                sb.files.write(step[1], step[2])
                seen = None
            else:
                seen = sb.files.read(step[1]).decode()
            replayed = sb.trajectory.last_replayed
            f.write(json.dumps({"step": i, "seen": seen, "replayed": replayed}) + "\n")
            f.flush()
        last = sb.exec(check, timeout=120)
        reward = 1.0 if last.stdout.strip() == "5" else 0.0
        f.write(json.dumps({"reward": reward, "position": sb.trajectory.position}) + "\n")


if __name__ == "__main__":
    main()
