"""The toy repository each rollout works on, and the candidate patches an "agent" proposes."""

from __future__ import annotations

import difflib

CALC = '''"""Small statistics helpers."""


def mean(xs):
    if not xs:
        raise ValueError("mean of an empty list")
    return sum(xs) / (len(xs) + 1)


def median(xs):
    ys = sorted(xs)
    n = len(ys)
    if n == 0:
        raise ValueError("median of an empty list")
    mid = n // 2
    return ys[mid] if n % 2 else (ys[mid - 1] + ys[mid]) / 2
'''

TESTS = """import unittest

from calc import mean, median


class CalcTest(unittest.TestCase):
    def test_mean(self):
        self.assertEqual(mean([1, 2, 3, 4]), 2.5)

    def test_mean_single(self):
        self.assertEqual(mean([7]), 7)

    def test_median(self):
        self.assertEqual(median([3, 1, 2]), 2)
        self.assertEqual(median([4, 1, 3, 2]), 2.5)

    def test_empty(self):
        with self.assertRaises(ValueError):
            mean([])


if __name__ == "__main__":
    unittest.main()
"""

FILES = {"calc.py": CALC, "test_calc.py": TESTS, "README.md": "A toy project for dsec's demo rollouts.\n"}


def _diff(before: str, after: str) -> str:
    return "".join(
        difflib.unified_diff(
            before.splitlines(keepends=True), after.splitlines(keepends=True), "a/calc.py", "b/calc.py"
        )
    )


# Three kinds of candidate an agent might produce: a right fix, a wrong fix, and a patch made
# against another version of the file (it does not apply).
CANDIDATES: dict[str, str] = {
    "correct": _diff(CALC, CALC.replace("(len(xs) + 1)", "len(xs)")),
    "wrong": _diff(CALC, CALC.replace("(len(xs) + 1)", "(len(xs) - 1)")),
    "stale": _diff(CALC.replace("Small statistics", "Tiny maths"), CALC.replace("Small statistics", "Tiny")),
}


def candidate_for(index: int) -> tuple[str, str]:
    name = ("correct", "wrong", "correct", "stale")[index % 4]
    return name, CANDIDATES[name]


# Run inside the sandbox: apply the candidate, run the tests; exit status 0 means reward 1.
GRADE = (
    "set -e; cd /work; git init -q . && git add -A && git -c user.email=a@b -c user.name=agent commit -qm base; "
    "git apply /tmp/candidate.diff || { echo PATCH_FAILED; exit 3; }; "
    "python3 -m unittest -q test_calc 2>&1"
)
