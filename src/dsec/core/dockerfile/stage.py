"""One stage of a Dockerfile, instruction by instruction: the image settings as they stand after each, and
for RUN, COPY and ADD the step to perform, with every variable expanded as Docker expands it (ENV of
the stage and of its base image over the ARGs in scope; RUN's shell expands its own).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from ...errors import InvalidRequest
from ...images.model import ImageConfig
from .parse import Dockerfile, Instruction, Stage, arg_declarations
from .words import expand, json_form, key_values, words

DEFAULT_SHELL = ("/bin/sh", "-c")
USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,31})?")
PORT = re.compile(r"[0-9]{1,5}(-[0-9]{1,5})?(/(tcp|udp|sctp))?")
SECRET_ID = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,127}")
REMOTE = ("http://", "https://", "git@", "git://", "ssh://")


@dataclass(frozen=True)
class Secret:
    """``RUN --mount=type=secret,id=X``: a secret the build was given, as a file (and, with env=, a variable)."""

    id: str
    target: str
    env: str | None
    required: bool


@dataclass(frozen=True)
class Run:
    inst: Instruction
    argv: list[str]
    env: dict[str, str]  # the image's ENV with the ARGs in scope under it
    user: str
    workdir: str
    secret: Secret | None


@dataclass(frozen=True)
class Copy:
    inst: Instruction
    sources: list[str]  # relative to the context, or paths in another stage or image (``source``)
    dest: str  # absolute; a trailing / says "a directory"
    source: str | None  # --from: a stage's name or index, or an image
    chown: str | None
    chmod: int | None
    add: bool  # ADD: a local tar archive is unpacked

    @property
    def into_directory(self) -> bool:
        return self.dest.endswith("/") or len(self.sources) > 1 or any(is_glob(s) for s in self.sources)


Step = Run | Copy


def is_glob(path: str) -> bool:
    return any(c in path for c in "*?[")


@dataclass
class Settings:
    """What the stage's image is configured with so far."""

    env: dict[str, str]
    workdir: str
    user: str
    entrypoint: list[str] | None
    cmd: list[str] | None
    labels: dict[str, str] = field(default_factory=dict)
    exposed: list[str] = field(default_factory=list)
    shell: list[str] = field(default_factory=lambda: list(DEFAULT_SHELL))

    @classmethod
    def of(cls, config: ImageConfig) -> Settings:
        return cls(
            env=dict(config.env),
            workdir=config.workdir,
            user=config.user,
            entrypoint=list(config.entrypoint) if config.entrypoint is not None else None,
            cmd=list(config.cmd) if config.cmd is not None else None,
            labels=dict(config.labels),
            exposed=list(config.exposed_ports),
        )

    def config(self) -> ImageConfig:
        return ImageConfig(
            env=dict(self.env),
            workdir=self.workdir,
            user=self.user,
            entrypoint=self.entrypoint,
            cmd=self.cmd,
            labels=dict(self.labels),
            exposed_ports=list(self.exposed),
        )


class StageReader:
    """Reads a stage's instructions in order: ``step(inst)`` applies a setting (None) or gives the step
    to build. ``build_args`` are the ``--build-arg`` values; a stage sees one only once it declares it."""

    def __init__(
        self,
        df: Dockerfile,
        stage: Stage,
        base: ImageConfig,
        global_args: Mapping[str, str],
        build_args: Mapping[str, str],
    ) -> None:
        self.df = df
        self.stage = stage
        self.settings = Settings.of(base)
        self.global_args = dict(global_args)
        self.build_args = dict(build_args)
        self.args: dict[str, str] = {}  # declared in this stage and set
        self.declared: set[str] = set()

    @property
    def scope(self) -> dict[str, str]:
        return {**self.args, **self.settings.env}

    def _words(self, inst: Instruction) -> list[str]:
        form = json_form(inst.value)
        if form is not None:
            return [expand(w, self.scope, self.df.escape) for w in form]
        return words(inst.value, self.scope, self.df.escape)

    def _command(self, inst: Instruction) -> list[str]:
        """RUN, CMD and ENTRYPOINT: the exec form as written, or the shell form run by SHELL."""
        form = json_form(inst.value)
        if form is not None:
            if not form and inst.keyword == "RUN":
                raise InvalidRequest(f"{inst.where()}: RUN [] has no command")
            return form
        return [*self.settings.shell, inst.value.strip()]

    def step(self, inst: Instruction) -> Step | None:
        handler = getattr(self, f"_{inst.keyword.lower()}")
        try:
            result: Step | None = handler(inst)
        except InvalidRequest as e:
            message = str(e)
            raise InvalidRequest(message if message.startswith("line ") else f"{inst.where()}: {message}") from None
        return result

    # ---- settings -----------------------------------------------------------------------------------

    def _arg(self, inst: Instruction) -> None:
        for name, default in arg_declarations(inst, self.df.escape):
            self.declared.add(name)
            if name in self.build_args:
                self.args[name] = self.build_args[name]
            elif default is not None:
                self.args[name] = expand(default, self.scope, self.df.escape)
            elif name in self.global_args:
                self.args[name] = self.global_args[name]

    def _env(self, inst: Instruction) -> None:
        for name, value in key_values(inst.value, self.scope, self.df.escape).items():
            if not re.fullmatch(r"[^=\x00]{1,255}", name):
                raise InvalidRequest(f"invalid variable name {name[:80]!r}")
            self.settings.env[name] = value

    def _label(self, inst: Instruction) -> None:
        self.settings.labels.update(key_values(inst.value, self.scope, self.df.escape))

    def _maintainer(self, inst: Instruction) -> None:
        self.settings.labels["maintainer"] = expand(inst.value.strip(), self.scope, self.df.escape)

    def _workdir(self, inst: Instruction) -> None:
        path = expand(inst.value.strip(), self.scope, self.df.escape)
        self.settings.workdir = posixpath.normpath(posixpath.join(self.settings.workdir, path))

    def _user(self, inst: Instruction) -> None:
        user = expand(inst.value.strip(), self.scope, self.df.escape)
        if not USER.fullmatch(user):
            raise InvalidRequest(f"invalid user {user[:80]!r}: a name or id, with an optional :group")
        self.settings.user = user

    def _entrypoint(self, inst: Instruction) -> None:
        self.settings.entrypoint = self._command(inst)
        self.settings.cmd = None  # Docker: a new ENTRYPOINT drops the CMD it inherited

    def _cmd(self, inst: Instruction) -> None:
        self.settings.cmd = self._command(inst)

    def _shell(self, inst: Instruction) -> None:
        form = json_form(inst.value)
        if not form:
            raise InvalidRequest('SHELL takes the JSON form, e.g. SHELL ["/bin/bash", "-c"]')
        self.settings.shell = form

    def _expose(self, inst: Instruction) -> None:
        for port in words(inst.value, self.scope, self.df.escape):
            if not PORT.fullmatch(port):
                raise InvalidRequest(f"invalid port {port[:40]!r}: PORT[-PORT][/tcp|udp|sctp]")
            port = port if "/" in port else port + "/tcp"
            if port not in self.settings.exposed:
                self.settings.exposed.append(port)

    # ---- steps that make layers ----------------------------------------------------------------------

    def _run(self, inst: Instruction) -> Run:
        secret = _secret(inst.flags["mount"], self.scope, self.df.escape) if "mount" in inst.flags else None
        args = {k: v for k, v in self.args.items() if k not in self.settings.env}
        return Run(
            inst=inst,
            argv=self._command(inst),
            env={**args, **self.settings.env},
            user=self.settings.user,
            workdir=self.settings.workdir,
            secret=secret,
        )

    def _copy(self, inst: Instruction) -> Copy:
        parts = self._words(inst)
        if len(parts) < 2:
            raise InvalidRequest(f"{inst.keyword} needs a source and a destination")
        *sources, dest = parts
        add = inst.keyword == "ADD"
        for src in sources:
            if src.startswith(REMOTE):
                raise InvalidRequest(f"ADD from a URL or git ({src[:80]}) is not supported; RUN curl or git instead")
        trailing = "/" if dest.endswith("/") or dest in (".", "..") else ""
        dest = posixpath.normpath(posixpath.join(self.settings.workdir, dest))
        dest = dest if dest == "/" else dest + trailing
        chown = expand(inst.flags["chown"], self.scope, self.df.escape) if "chown" in inst.flags else None
        if chown is not None and not USER.fullmatch(chown):
            raise InvalidRequest(f"invalid --chown {chown[:80]!r}: user[:group], names or ids")
        source = expand(inst.flags["from"], self.scope, self.df.escape) if "from" in inst.flags else None
        return Copy(
            inst=inst,
            sources=sources,
            dest=dest,
            source=source,
            chown=chown,
            chmod=_mode(inst.flags.get("chmod")),
            add=add,
        )

    _add = _copy


def _mode(text: str | None) -> int | None:
    if text is None:
        return None
    if not re.fullmatch(r"[0-7]{1,4}", text):
        raise InvalidRequest(f"--chmod={text[:40]}: dsec takes an octal mode (e.g. 755)")
    return int(text, 8)


def _secret(spec: str, scope: Mapping[str, str], escape: str) -> Secret:
    """``type=secret,id=X[,target=/path][,env=NAME][,required=true]`` (other mount types are refused)."""
    fields: dict[str, str] = {}
    for part in expand(spec, scope, escape).split(","):
        key, eq, value = part.partition("=")
        fields[key.strip()] = value.strip() if eq else "true"
    kind = fields.pop("type", "bind")
    if kind != "secret":
        raise InvalidRequest(f"RUN --mount=type={kind} is not supported (dsec has type=secret)")
    sid = fields.pop("id", "")
    target = fields.pop("target", fields.pop("dst", fields.pop("destination", "")))
    if not sid and target:
        sid = posixpath.basename(target)
    if not SECRET_ID.fullmatch(sid):
        raise InvalidRequest(f"RUN --mount=type=secret needs id=NAME (got {sid[:80]!r})")
    target = target or f"/run/secrets/{sid}"
    if not target.startswith("/") or "\0" in target:
        raise InvalidRequest(f"RUN --mount secret target {target[:80]!r} must be an absolute path")
    env = fields.pop("env", None)
    required = fields.pop("required", "false").lower() in ("true", "1", "yes")
    if fields:
        raise InvalidRequest(f"RUN --mount=type=secret: unknown option(s) {sorted(fields)}")
    return Secret(id=sid, target=posixpath.normpath(target), env=env, required=required)
