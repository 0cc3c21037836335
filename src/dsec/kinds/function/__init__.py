"""The function kind: warm pools of reusable container workers (issue 6)."""
