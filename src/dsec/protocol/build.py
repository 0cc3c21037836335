"""Image build specs: a declarative file (TOML) or the Python builder, both giving one ``BuildSpec``.

Each step that changes files becomes one layer, cached by the hash of everything that went into it
(the layers under it, the step itself, the bytes it copies, the non-secret arguments it sees).

    name = "myorg/env:1"
    from = "dsec/debian:12"
    env = { LANG = "C.UTF-8" }
    workdir = "/work"
    scrub = ["work/answers/*"]

    [[steps]]
    apt = ["python3-numpy"]

    [[steps]]
    copy = { src = "./repo", dest = "/work/repo" }

    [[steps]]
    run = "cd /work/repo && make"
    secrets = ["GH_TOKEN"]
"""

from __future__ import annotations

import json
import tomllib
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Literal

import blake3
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema, model_validator

from ..errors import InvalidRequest, validation_message
from .names import ImageName
from .residue import ScrubRule
from .types import BLANK, NO_NUL, PATH_MAX, USER_SPEC, AbsPath, Env, EnvName


class LayerRole(StrEnum):
    """What a layer holds; layers of different roles are versioned and shared separately."""

    base = "base"  # the operating system
    toolkit = "toolkit"  # languages, compilers, packages
    workspace = "workspace"  # the task's repository and data
    diff = "diff"  # a sandbox's changes (pack_diff)


MAX_PACKAGES = 1024  # per apt or pip step
MAX_PACKAGE = 512  # characters of one package name or requirement
# a package name (with a version), no option and no white space; not '-' first
PACKAGE = rf"^[^\-\x00{BLANK}][^\x00{BLANK}]*$"


def _check_package(package: str) -> str:
    bad = package.startswith("-") or "\0" in package or any(c.isspace() for c in package)
    if not package or bad or len(package) > MAX_PACKAGE:
        raise ValueError(f"invalid package {package[:80]!r}: a name (with a version), no options or spaces")
    return package


Package = Annotated[
    str,
    AfterValidator(_check_package),
    WithJsonSchema({"type": "string", "minLength": 1, "maxLength": MAX_PACKAGE, "pattern": PACKAGE}),
]

HOST_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
BUILDER_CA = "/etc/dsec-build/ca-certificates.crt"  # where a builder finds the host's CAs (scrubbed from layers)


class CopyStep(BaseModel):
    model_config = ConfigDict(extra="forbid")

    src: str = Field(
        max_length=PATH_MAX,
        pattern=NO_NUL,
        description="A file or directory on the client; the SDK uploads it as a build context.",
    )
    dest: AbsPath = Field(description="Absolute destination directory in the image.")
    context: str | None = Field(
        default=None, pattern=r"^[0-9a-f]{64}$", description="blake3 of the uploaded tar (set by the SDK)."
    )


# a step's action and its JSON type: the schema's oneOf says a step has exactly one (a null is none)
ACTIONS = {"apt": "array", "pip": "array", "copy": "object", "run": "string", "env": "object", "workdir": "string"}


class Step(BaseModel):
    """Exactly one action per step: apt, pip, copy, run, env or workdir."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "oneOf": [{"required": [a], "properties": {a: {"type": t}}} for a, t in ACTIONS.items()],
        },
    )

    apt: list[Package] | None = Field(default=None, max_length=MAX_PACKAGES, description="Debian packages to install.")
    pip: list[Package] | None = Field(
        default=None, max_length=MAX_PACKAGES, description="Python requirements to install."
    )
    copy_: CopyStep | None = Field(default=None, alias="copy")
    run: str | None = Field(default=None, max_length=1 << 16, pattern=NO_NUL, description="A shell command.")
    env: Env | None = Field(default=None, description="Set in the image config (no layer).")
    workdir: AbsPath | None = Field(default=None, description="Set in the image config (no layer).")
    role: LayerRole | None = Field(default=None, description="Default: toolkit for apt/pip, workspace otherwise.")
    secrets: list[EnvName] = Field(
        default_factory=list, max_length=MAX_PACKAGES, description="Secret arguments this step sees as env vars."
    )
    timeout: float = Field(default=3600.0, gt=0, le=24 * 3600)

    @model_validator(mode="after")
    def _one_action(self) -> Step:
        actions = [a for a in ("apt", "pip", "copy_", "run", "env", "workdir") if getattr(self, a) is not None]
        if len(actions) != 1:
            raise ValueError(f"a step needs exactly one of apt, pip, copy, run, env, workdir (got {actions or 'none'})")
        return self

    @property
    def makes_layer(self) -> bool:
        return self.env is None and self.workdir is None

    @property
    def layer_role(self) -> LayerRole:
        if self.role is not None:
            return self.role
        return LayerRole.toolkit if (self.apt or self.pip) else LayerRole.workspace

    def describe(self) -> str:
        if self.apt is not None:
            return "apt " + " ".join(self.apt)
        if self.pip is not None:
            return "pip " + " ".join(self.pip)
        if self.copy_ is not None:
            return f"copy {self.copy_.src} {self.copy_.dest}"
        if self.run is not None:
            return "run " + (self.run if len(self.run) <= 80 else self.run[:77] + "...")
        if self.env is not None:
            return "env " + " ".join(f"{k}={v}" for k, v in self.env.items())
        return f"workdir {self.workdir}"

    def command(self) -> str | None:
        """The shell command that performs this step in a builder sandbox (None: copy or config only)."""
        if self.apt is not None:
            pkgs = " ".join(self.apt)
            return (
                "set -e; export DEBIAN_FRONTEND=noninteractive; apt-get update -q; "
                f"apt-get install -y -q --no-install-recommends {pkgs}; apt-get clean"
            )
        if self.pip is not None:
            reqs = " ".join(json.dumps(r) for r in self.pip)
            return (
                "set -e; py=$(command -v python3 || command -v python); "
                f'"$py" -m pip install --no-cache-dir --break-system-packages {reqs} '
                f'|| "$py" -m pip install --no-cache-dir {reqs}'
            )
        return self.run


class BuildSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: ImageName = Field(description="repo:tag of the image to publish.")
    base: ImageName = Field(alias="from", description="The image to build on.")
    env: Env = Field(default_factory=dict)
    workdir: AbsPath | None = None
    user: str | None = Field(
        default=None,
        pattern=USER_SPEC,
        description="The runtime account sandboxes of the image run as (steps always run as the builder, root).",
    )
    entrypoint: list[Annotated[str, Field(max_length=PATH_MAX, pattern=NO_NUL)]] | None = Field(
        default=None, max_length=1024
    )
    steps: list[Step] = Field(default_factory=list, max_length=256)
    scrub: list[ScrubRule] = Field(
        default_factory=list, max_length=1024, description="Residue rules on top of the node's defaults."
    )
    scrub_defaults: bool = True
    scrub_git: bool = Field(default=False, description="Drop git objects unreachable from HEAD before packing.")
    description: str = Field(default="", max_length=4096)

    def step_key(self, parent_key: str, step: Step, args: dict[str, str]) -> str:
        """The cache key of a step's layer: what it was built on, what it does, what it could see."""
        visible = dict(sorted(args.items())) if step.command() is not None else {}  # a copy sees no args
        payload = {
            "parent": parent_key,
            "step": step.model_dump(mode="json", by_alias=True, exclude={"timeout"}),
            "args": visible,
            "scrub": [self.scrub, self.scrub_defaults, self.scrub_git],
        }
        return blake3.blake3(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def load_spec(path: Path) -> BuildSpec:
    """A spec file; relative ``copy.src`` paths are taken relative to the file's directory."""
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise InvalidRequest(f"cannot read build spec {path}: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise InvalidRequest(f"build spec {path} is not valid TOML: {e}") from None
    try:
        spec = BuildSpec.model_validate(data)
    except ValidationError as e:
        raise InvalidRequest(f"build spec {path}: {validation_message(e)}") from None
    for step in spec.steps:
        if step.copy_ is not None and not Path(step.copy_.src).is_absolute():
            step.copy_.src = str((path.parent / step.copy_.src).resolve())
    return spec


class ImageSpec:
    """The Python builder: ``ImageSpec("dsec/debian:12").apt("gcc").pip("pytest").copy("./repo", "/work")``."""

    def __init__(self, base: str) -> None:
        self._base = base
        self._steps: list[Step] = []
        self._env: dict[str, str] = {}
        self._workdir: str | None = None
        self._scrub: list[str] = []
        self._scrub_git = False
        self._user: str | None = None

    def _add(self, **kw: object) -> ImageSpec:
        try:
            self._steps.append(Step.model_validate(kw))
        except ValidationError as e:
            raise InvalidRequest(validation_message(e)) from None
        return self

    def apt(self, *packages: str, role: Literal["base", "toolkit", "workspace"] | None = None) -> ImageSpec:
        return self._add(apt=list(packages), role=role)

    def pip(self, *requirements: str, role: Literal["base", "toolkit", "workspace"] | None = None) -> ImageSpec:
        return self._add(pip=list(requirements), role=role)

    def copy(self, src: str | Path, dest: str) -> ImageSpec:
        return self._add(copy={"src": str(Path(src).resolve()), "dest": dest})

    def run(self, command: str, *, secrets: list[str] | None = None, timeout: float = 3600.0) -> ImageSpec:
        return self._add(run=command, secrets=secrets or [], timeout=timeout)

    def env(self, **values: str) -> ImageSpec:
        self._env.update(values)
        return self

    def workdir(self, path: str) -> ImageSpec:
        self._workdir = path
        return self

    def user(self, account: str) -> ImageSpec:
        """The runtime account (it must exist in the image, e.g. made by a run step)."""
        self._user = account
        return self

    def scrub(self, *rules: str, git: bool = False) -> ImageSpec:
        self._scrub.extend(rules)
        self._scrub_git = self._scrub_git or git
        return self

    def spec(self, name: str, description: str = "") -> BuildSpec:
        try:
            return BuildSpec.model_validate(
                {
                    "name": name,
                    "from": self._base,
                    "env": self._env,
                    "workdir": self._workdir,
                    "user": self._user,
                    "steps": [s.model_dump(by_alias=True, exclude_none=True) for s in self._steps],
                    "scrub": self._scrub,
                    "scrub_git": self._scrub_git,
                    "description": description,
                }
            )
        except ValidationError as e:
            raise InvalidRequest(validation_message(e)) from None
