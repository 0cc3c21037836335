"""A Dockerfile read into stages of instructions, each with its flags, before any variable is expanded
(the base image's ENV takes part in that, so it happens as a stage is built: ``stage.py``).

dockerfile-parse does the lexical part (continuation lines, comments, the escape directive); this module
checks what dsec can build and says plainly what it cannot, naming the instruction and its line.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass, field

from dockerfile_parse import DockerfileParser  # type: ignore[import-untyped]

from ...errors import InvalidRequest
from ...protocol.sandbox import MAX_DOCKERFILE
from .words import expand, split_raw

MAX_STAGES = 64
MAX_INSTRUCTIONS = 1024

# the flags each instruction takes (anything else is refused by name)
FLAGS: dict[str, frozenset[str]] = {
    "FROM": frozenset({"platform"}),
    "RUN": frozenset({"mount"}),
    "COPY": frozenset({"from", "chown", "chmod", "link"}),
    "ADD": frozenset({"chown", "chmod", "link"}),
    "ENV": frozenset(),
    "ARG": frozenset(),
    "WORKDIR": frozenset(),
    "USER": frozenset(),
    "LABEL": frozenset(),
    "ENTRYPOINT": frozenset(),
    "CMD": frozenset(),
    "SHELL": frozenset(),
    "EXPOSE": frozenset(),
    "MAINTAINER": frozenset(),
}
REFUSED = {
    "HEALTHCHECK": "dsec does not run health checks; remove it, or check readiness from the harness",
    "ONBUILD": "triggers for images built FROM this one are not supported",
    "VOLUME": "anonymous volumes are not supported; mount a named volume at create (volumes=...)",
    "STOPSIGNAL": "sandboxes are stopped by dsec, not by a signal the image chooses",
}
HEREDOC = re.compile(r"""<<-?["']?[A-Za-z_][A-Za-z0-9_]*["']?""")
ESCAPE_DIRECTIVE = re.compile(r"^\s*#\s*escape\s*=\s*([\\`])\s*$", re.I)
PLATFORMS = {"linux/amd64", "$BUILDPLATFORM", "$TARGETPLATFORM", "${BUILDPLATFORM}", "${TARGETPLATFORM}"}


@dataclass(frozen=True)
class Instruction:
    line: int  # 1-based, where it starts
    keyword: str  # upper case
    flags: dict[str, str]  # --name=value, value as written
    value: str  # the arguments after the flags, as written
    text: str  # the whole instruction on one line, for messages and build steps' descriptions

    def where(self) -> str:
        return f"line {self.line} ({self.keyword})"


@dataclass
class Stage:
    index: int
    base: str  # as written (variables expanded later from the global ARGs)
    name: str | None
    line: int
    instructions: list[Instruction] = field(default_factory=list)

    def label(self) -> str:
        return self.name or str(self.index)


@dataclass
class Dockerfile:
    escape: str
    global_args: list[Instruction]  # the ARGs before the first FROM
    stages: list[Stage]

    def stage(self, ref: str, before: int) -> Stage | None:
        """The stage ``ref`` names (its name, or its index) among those before stage ``before``."""
        for stage in self.stages[:before]:
            if stage.name == ref.lower() or (ref.isdigit() and int(ref) == stage.index):
                return stage
        return None

    def target(self, name: str | None) -> Stage:
        if name is None:
            return self.stages[-1]
        found = self.stage(name, len(self.stages))
        if found is None:
            names = [s.name for s in self.stages if s.name]
            raise InvalidRequest(f"no stage named {name!r} in the Dockerfile (its stages: {names or 'unnamed'})")
        return found


def _flags(inst: str, value: str, line: int) -> tuple[dict[str, str], str]:
    """The leading ``--name=value`` flags of an instruction and the rest of its arguments."""
    flags: dict[str, str] = {}
    rest = value.lstrip()
    while rest.startswith("--"):
        word = split_raw(rest)[0]
        name, eq, val = word[2:].partition("=")
        if name not in FLAGS[inst]:
            known = ", ".join(f"--{f}" for f in sorted(FLAGS[inst])) or "none"
            raise InvalidRequest(f"line {line}: {inst} --{name} is not supported (dsec knows: {known})")
        if name == "mount" and "mount" in flags:
            raise InvalidRequest(f"line {line}: RUN takes one --mount in dsec")
        flags[name] = val if eq else "true"
        rest = rest[len(word) :].lstrip()
    return flags, rest


def _instruction(item: dict[str, object], escape: str) -> Instruction:
    keyword = str(item["instruction"]).upper()
    line = int(str(item["startline"])) + 1
    value = str(item["value"] or "")
    if keyword in REFUSED:
        raise InvalidRequest(f"line {line}: {keyword} is not supported: {REFUSED[keyword]}")
    if keyword not in FLAGS:
        raise InvalidRequest(f"line {line}: unknown instruction {keyword[:40]!r}")
    flags, rest = _flags(keyword, value, line)
    # BuildKit reads <<EOF in these as a here-document whose body follows on the next lines, which would
    # read as instructions here: refused before that can happen
    if keyword in ("RUN", "COPY", "ADD") and any(HEREDOC.fullmatch(w) for w in rest.split()):
        raise InvalidRequest(f"line {line}: {keyword} with a here-document (<<) is not supported; use a file")
    if not rest.strip():
        raise InvalidRequest(f"line {line}: {keyword} needs arguments")
    text = " ".join(str(item["content"]).replace(escape + "\n", " ").split())
    return Instruction(line=line, keyword=keyword, flags=flags, value=rest, text=text[:500])


def _stage(inst: Instruction, index: int) -> Stage:
    parts = split_raw(inst.value)
    platform = inst.flags.get("platform")
    if platform is not None and platform not in PLATFORMS:
        raise InvalidRequest(f"{inst.where()}: --platform={platform} (dsec builds linux/amd64 only)")
    if len(parts) == 3 and parts[1].lower() == "as":
        name = parts[2].lower()
        if not re.fullmatch(r"[a-z][a-z0-9_.-]{0,62}", name):
            raise InvalidRequest(f"{inst.where()}: invalid stage name {parts[2][:80]!r}")
        return Stage(index=index, base=parts[0], name=name, line=inst.line)
    if len(parts) != 1:
        raise InvalidRequest(f"{inst.where()}: expected FROM image [AS name], got {inst.value[:200]!r}")
    return Stage(index=index, base=parts[0], name=None, line=inst.line)


def parse(text: str) -> Dockerfile:
    """The Dockerfile's stages; an error names the line and what is wrong."""
    if len(text.encode()) > MAX_DOCKERFILE:
        raise InvalidRequest(f"the Dockerfile is over {MAX_DOCKERFILE >> 10} KiB")
    if "\0" in text:
        raise InvalidRequest("the Dockerfile holds a NUL byte")
    escape = "\\"
    for line in text.splitlines():
        if not line.strip().startswith("#"):
            break
        if m := ESCAPE_DIRECTIVE.match(line):
            escape = m.group(1)
    parser = DockerfileParser(fileobj=io.BytesIO(text.encode()), env_replace=False)
    structure = parser.structure
    items = [i for i in structure if i["instruction"] != "COMMENT"]
    if len(items) > MAX_INSTRUCTIONS:
        raise InvalidRequest(f"the Dockerfile has over {MAX_INSTRUCTIONS} instructions")
    global_args: list[Instruction] = []
    stages: list[Stage] = []
    for item in items:
        inst = _instruction(item, escape)
        if inst.keyword == "FROM":
            if len(stages) >= MAX_STAGES:
                raise InvalidRequest(f"{inst.where()}: over {MAX_STAGES} stages")
            stage = _stage(inst, len(stages))
            if stage.name is not None and any(s.name == stage.name for s in stages):
                raise InvalidRequest(f"{inst.where()}: a second stage named {stage.name!r}")
            stages.append(stage)
        elif not stages:
            if inst.keyword != "ARG":
                raise InvalidRequest(f"{inst.where()}: only ARG may come before the first FROM")
            global_args.append(inst)
        else:
            stages[-1].instructions.append(inst)
    _check_covered(text, structure)
    if not stages:
        raise InvalidRequest("the Dockerfile has no FROM")
    return Dockerfile(escape=escape, global_args=global_args, stages=stages)


def _check_covered(text: str, structure: list[dict[str, object]]) -> None:
    """dockerfile-parse passes over a line that is a lone word (``WORKDIR``): such a line is an error
    here, not a silent skip."""
    covered: set[int] = set()
    for item in structure:
        covered.update(range(int(str(item["startline"])), int(str(item["endline"])) + 1))
    for n, line in enumerate(text.splitlines()):
        if n not in covered and line.strip():
            word = line.strip().split()[0].upper()
            what = (
                f"{word} needs arguments" if word in FLAGS or word in REFUSED else f"cannot read {line.strip()[:80]!r}"
            )
            raise InvalidRequest(f"line {n + 1}: {what}")


def arg_declarations(inst: Instruction, escape: str) -> list[tuple[str, str | None]]:
    """``ARG a b=1``: the names declared, each with its default as written (None: none)."""
    out: list[tuple[str, str | None]] = []
    for word in split_raw(inst.value, escape):
        name, eq, default = word.partition("=")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise InvalidRequest(f"{inst.where()}: invalid argument name {name[:80]!r}")
        out.append((name, default if eq else None))
    return out


def global_scope(df: Dockerfile, build_args: dict[str, str]) -> dict[str, str]:
    """The ARGs before the first FROM: what FROM lines may use, and defaults for a stage's own ARG."""
    scope: dict[str, str] = {}
    for inst in df.global_args:
        for name, default in arg_declarations(inst, df.escape):
            if name in build_args:
                scope[name] = build_args[name]
            elif default is not None:
                scope[name] = expand(default, scope, df.escape)
    return scope
