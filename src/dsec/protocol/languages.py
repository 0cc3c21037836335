"""The languages source code can be run in: how each is compiled and run in a sandbox, and what a
compile-then-run gives back (core/compiled.py does it; the SandboxFusion API and one-shot runs use it).

Every program here comes with the built-in image ``dsec/code:1`` (Debian 12: GCC 12, Go 1.19, OpenJDK 17,
Node.js 18, Python 3.11); python, bash and sh run on ``dsec/debian:12`` too. Argv is run in the run's
directory, where the source was written under its language's file name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, Field

from .sandbox import ExecResult

# an argument holding it gets the sandbox's memory limit in bytes: the JVM sizes its heap from the
# machine's memory, and a function worker shows it no cgroup file system to find its real limit in
MEMORY = "{memory}"


@dataclass(frozen=True)
class Language:
    name: str
    source: str  # the file name the code is written to, in the run's directory
    compile: tuple[str, ...] | None  # None: interpreted
    run: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)  # set for both steps (over the image's)

    def argv(self, step: tuple[str, ...], memory: int) -> list[str]:
        return [arg.replace(MEMORY, str(memory)) for arg in step]


# The JVM's serial collector: one collector thread in a sandbox that asks for a quarter of a core, and
# its smaller footprint; javac, a JVM program run once, starts faster with only the first JIT tier.
_JVM = ("-XX:+UseSerialGC", f"-XX:MaxRAM={MEMORY}")

LANGUAGES: dict[str, Language] = {
    lang.name: lang
    for lang in (
        Language("python", "main.py", None, ("python3", "main.py")),
        Language("bash", "main.sh", None, ("bash", "main.sh")),
        Language("sh", "main.sh", None, ("/bin/sh", "main.sh")),
        Language("c", "main.c", ("gcc", "-std=gnu17", "-O2", "-o", "main", "main.c", "-lm"), ("./main",)),
        Language("cpp", "main.cpp", ("g++", "-std=gnu++17", "-O2", "-o", "main", "main.cpp", "-lpthread"), ("./main",)),
        # GOCACHE and GOPATH in the run's directory (emptied between uses of a function worker), for
        # images that set neither and have no HOME
        Language(
            "go",
            "main.go",
            ("go", "build", "-o", "main", "main.go"),
            ("./main",),
            {"GOCACHE": "/tmp/.go-cache", "GOPATH": "/tmp/.go"},
        ),
        # the public class must be Main, as SandboxFusion's java runner requires
        Language(
            "java",
            "Main.java",
            ("javac", "-encoding", "UTF-8", *(f"-J{a}" for a in (*_JVM, "-XX:TieredStopAtLevel=1")), "Main.java"),
            ("java", *_JVM, "-cp", ".", "Main"),
        ),
        Language("nodejs", "main.js", None, ("node", "main.js")),
    )
}
LanguageName = Literal["python", "bash", "sh", "c", "cpp", "go", "java", "nodejs"]
COMPILED = tuple(name for name, lang in LANGUAGES.items() if lang.compile is not None)


def supported() -> str:
    return ", ".join(sorted(LANGUAGES))


StepStatus = Literal["finished", "timeout", "error"]


class StepResult(ExecResult):
    """One step (the compile or the run) as the process ended."""

    status: StepStatus = Field(
        description="finished: the process ended by itself (whatever its exit status); timeout: killed at "
        "its time limit; error: it could not start (its program is not in the image)."
    )


class CompileRunResult(BaseModel):
    language: str
    compile: StepResult | None = Field(None, description="None for an interpreted language.")
    run: StepResult | None = Field(None, description="None when the compile failed, timed out or could not start.")

    @property
    def ok(self) -> bool:
        """Compiled (if it is compiled) and ran to exit status 0 within its time."""
        return self.run is not None and self.run.status == "finished" and self.run.exit_code == 0
