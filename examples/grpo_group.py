"""A GRPO-style training loop on dsec, with a scripted policy instead of a model.

One environment is prepared once (a small repository with a bug) and snapshotted as an image; every step
fans it out to a *group* of rollouts, each a fresh sandbox of that image in which the policy acts; each
rollout is graded from the host (``sb.grade``: the hidden test runs in a pristine sibling sandbox, against
a read-only copy of the rollout's work, so nothing the policy did can fake a pass). The rewards of a
group give group-relative advantages, (r - mean) / std, and the policy moves toward the actions that
beat their group: the mean reward climbs from step to step.

    python examples/grpo_group.py --steps 4 --group 8          # DSEC_URL / DSEC_TOKEN name the daemon

Swap ``Policy`` for a model and ``act`` for its tool calls, and this is the shape of a real loop.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import math
import random
import statistics
import time
from dataclasses import dataclass, field

import dsec

REPO = "/work/repo"
BUGGY = "def mean(xs):\n    return sum(xs) / (len(xs) - 1)\n"
HIDDEN_TEST = """import sys, unittest
sys.path.insert(0, "/work/repo")
from stats import mean

class T(unittest.TestCase):
    def test_mean(self):
        self.assertEqual(mean([1, 2, 3, 6]), 3)

    def test_one(self):
        self.assertEqual(mean([5]), 5)

unittest.main()
"""

# What the scripted policy can do: shell commands run in the rollout's sandbox. One fixes the bug.
ACTIONS = {
    "fix": f"sed -i 's|(len(xs) - 1)|len(xs)|' {REPO}/stats.py",
    "off-by-one-the-other-way": f"sed -i 's|(len(xs) - 1)|(len(xs) + 1)|' {REPO}/stats.py",
    "delete-the-function": f": > {REPO}/stats.py",
    "edit-a-readme": f"echo 'fixed, probably' >> {REPO}/README",
}


@dataclass
class Policy:
    """A softmax over the scripted actions: the 'model' this loop trains."""

    logits: dict[str, float] = field(default_factory=lambda: dict.fromkeys(ACTIONS, 0.0))
    lr: float = 1.0

    def probabilities(self) -> dict[str, float]:
        top = max(self.logits.values())
        weights = {a: math.exp(v - top) for a, v in self.logits.items()}
        total = sum(weights.values())
        return {a: w / total for a, w in weights.items()}

    def sample(self, rng: random.Random) -> str:
        probs = self.probabilities()
        return rng.choices(list(probs), weights=list(probs.values()))[0]

    def update(self, actions: list[str], advantages: list[float]) -> None:
        """A policy-gradient step: each action's logit moves by its mean advantage in the group."""
        for action in set(actions):
            mine = [adv for a, adv in zip(actions, advantages, strict=True) if a == action]
            self.logits[action] += self.lr * statistics.fmean(mine)


async def prepare(client: dsec.AsyncClient, image: str) -> str:
    """The environment every rollout starts from: made once, then an image (a snapshot of its changes)."""
    tag = hashlib.sha256((BUGGY + HIDDEN_TEST).encode()).hexdigest()[:12]
    name = f"examples/grpo-env:{tag}"
    try:
        await client.image(name)
        return name  # prepared by an earlier run: the same inputs, the same image
    except dsec.ImageNotFound:
        pass
    async with await dsec.AsyncSandbox.create(image, client=client) as sb:
        await sb.exec(["mkdir", "-p", REPO])
        await sb.files.write(f"{REPO}/stats.py", BUGGY.encode())
        await sb.files.write(f"{REPO}/README", b"compute a mean\n")
        await sb.snapshot(name, description="examples/grpo_group.py: the buggy repository")
    return name


async def rollout(client: dsec.AsyncClient, env: str, kind: str, action: str) -> float:
    """One trajectory: a fresh sandbox of the prepared image, the policy's action, a grade from the host."""
    async with await dsec.AsyncSandbox.create(env, kind=kind, client=client) as sb:
        await sb.exec(ACTIONS[action])
        graded = await sb.grade(
            ["python3", "-I", "/grade/test_stats.py"], paths=[REPO], tests={"test_stats.py": HIDDEN_TEST}
        )
        return 1.0 if graded.result.exit_code == 0 else 0.0


def advantages(rewards: list[float]) -> list[float]:
    mean = statistics.fmean(rewards)
    std = statistics.pstdev(rewards)
    return [(r - mean) / (std + 1e-6) for r in rewards]


async def main(steps: int, group: int, kind: str, image: str, seed: int) -> list[float]:
    rng = random.Random(seed)
    policy = Policy()
    client = dsec.AsyncClient()
    env = await prepare(client, image)
    print(f"environment image: {env}")
    means = []
    for step in range(1, steps + 1):
        started = time.monotonic()
        actions = [policy.sample(rng) for _ in range(group)]
        rewards = list(await asyncio.gather(*(rollout(client, env, kind, a) for a in actions)))
        policy.update(actions, advantages(rewards))
        means.append(statistics.fmean(rewards))
        p_fix = policy.probabilities()["fix"]
        print(
            f"step {step}: {group} rollouts in {time.monotonic() - started:.1f}s, mean reward {means[-1]:.2f}, "
            f"P(fix) now {p_fix:.2f}  ({', '.join(f'{a}={r:.0f}' for a, r in zip(actions, rewards, strict=True))})"
        )
    await client.aclose()
    return means


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--group", type=int, default=8, help="rollouts per step (GRPO's group size)")
    parser.add_argument("--kind", default="container", help="sandbox kind of the rollouts")
    parser.add_argument("--image", default="dsec/debian:12", help="the image the environment is prepared on")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    asyncio.run(main(args.steps, args.group, args.kind, args.image, args.seed))
