"""docs/benchmarks.md tells the truth about how its figures were made: every command it shows exists with
the flags it shows, every file it links is committed, and every measured table sits under a command and
links the JSON of its run."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import typer

from dsec.cli.main import app

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "benchmarks.md"
# sections whose tables are not measurements of a run
UNMEASURED = ("Not measured here",)


def _commands(text: str) -> list[list[str]]:
    """The `dsec bench ...` lines of the document's shell blocks, continuation lines joined."""
    found = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith("dsec bench "):
                found.append(shlex.split(line))
    return found


def _sections(text: str) -> list[tuple[str, str]]:
    """(title, body) of each '## ' section, and of each bold-titled run inside one ('**Idle containers**')."""
    out = []
    for part in re.split(r"^## ", text, flags=re.M)[1:]:
        title, _, body = part.partition("\n")
        runs = re.split(r"^(?=\*\*[^*\n]+\*\* \()", body, flags=re.M)
        out.append((title, runs[0]))
        out += [(f"{title}: {r.split('**')[1]}", r) for r in runs[1:]]
    return out


def test_every_bench_command_and_flag_exists() -> None:
    group: Any = typer.main.get_command(app)
    bench: Any = group.commands["bench"]
    commands = _commands(DOC.read_text())
    assert commands, "no `dsec bench` command in docs/benchmarks.md"
    for argv in commands:
        name = argv[2]
        assert name in bench.commands, f"`dsec bench {name}` does not exist"
        options = {opt for p in bench.commands[name].params for opt in (*p.opts, *p.secondary_opts)}
        for token in argv[3:]:
            if token.startswith("--"):
                flag = token.split("=", 1)[0]
                assert flag in options, f"`dsec bench {name}` has no {flag} (docs/benchmarks.md: {' '.join(argv)})"


def test_every_linked_file_is_committed() -> None:
    tracked = set(subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split())
    for link in re.findall(r"\]\((benchmarks/[^)#]+)\)", DOC.read_text()):
        path = f"docs/{link}".rstrip("/")
        assert path in tracked or any(t.startswith(path + "/") for t in tracked), f"{path} is not committed"


def test_every_measured_table_names_its_command_and_its_json() -> None:
    for title, body in _sections(DOC.read_text()):
        if title.startswith(UNMEASURED) or not re.search(r"^\|.*\|$", body, re.M):
            continue
        assert re.search(r"```sh\n(?:.*\n)*?\S*dsec bench ", body) or "`dsec bench " in body, (
            f"section {title!r} has a table but names no `dsec bench` command"
        )
        assert re.search(r"\]\(benchmarks/[^)]+\.json\)", body), f"section {title!r} links no JSON of its run"
