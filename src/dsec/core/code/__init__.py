"""Stateful code execution in a sandbox (``sb.run_code``): the daemon's side (runner.py) and the program
that runs in the sandbox (driver.py, standard library only)."""

from .runner import CodeRunner

__all__ = ["CodeRunner"]
