"""An E2B template's steps as a Dockerfile for dsec's Dockerfile builder (core/dockerfile): the engine that
already runs each step in a builder sandbox, caches and scrubs its layer, and publishes one image.

E2B's own rules are kept: a template starts as the account ``user`` in ``/home/user`` (made if the base
image has no such account, as E2B's provisioning makes it), ``set_user`` makes the account it names when
missing, a step's ``user`` applies to that step only, and the last user and workdir are the image's. The
text is generated, never pasted: commands go in RUN's exec form (JSON), so no quoting of theirs can
change the Dockerfile, and every other value is escaped or refused.
"""

from __future__ import annotations

import json
import posixpath
import re
from dataclasses import dataclass, field

from ..errors import InvalidRequest
from .template_models import BuildStart, Step

BASE_STEP = "base"  # E2B's name of the step that makes the base (FROM and provisioning)
FINALIZE_STEP = "finalize"  # E2B's name of what follows the steps (start and ready commands)
DEFAULT_USER = "user"
ROOT = "root"
ACCOUNT = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
OWNER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,31})?")
MODE = re.compile(r"0?[0-7]{3,4}")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,254}")
FORCE_ARG = "DSEC_E2B_BUILD"  # an ARG whose value is the build id: a forced step's cache key is new
# bash if the image has it (E2B's commands are bash's), else the image's sh; the command is $1
SHELL = 'if command -v bash >/dev/null 2>&1; then exec bash -c "$1"; fi; exec sh -c "$1"'
# the account $1 with home /home/$1, unless it exists: useradd (Debian, Ubuntu, Fedora, Arch), BusyBox's
# adduser (Alpine), or the files themselves
ACCOUNT_SCRIPT = r"""
id "$1" >/dev/null 2>&1 && exit 0
if command -v useradd >/dev/null 2>&1; then
  shell=/bin/sh; [ -x /bin/bash ] && shell=/bin/bash
  useradd -m -d "/home/$1" -s "$shell" "$1"
elif command -v adduser >/dev/null 2>&1; then
  adduser -D -h "/home/$1" "$1"
else
  uid=1000; while grep -q "^[^:]*:[^:]*:$uid:" /etc/passwd; do uid=$((uid + 1)); done
  echo "$1:x:$uid:$uid::/home/$1:/bin/sh" >> /etc/passwd
  echo "$1:x:$uid:" >> /etc/group
  mkdir -p "/home/$1" && chown "$uid:$uid" "/home/$1"
fi
"""
# WORKDIR's directory ($1, from the workdir before it), made for the current account ($2) if it is new, so
# that the account may write where its later steps run
WORKDIR_SCRIPT = '[ -e "$1" ] || { mkdir -p -- "$1" && chown "$2" "$1"; }'


@dataclass
class Plan:
    dockerfile: str
    steps: dict[int, str] = field(default_factory=dict)  # a Dockerfile line -> E2B's step ("base", "1", ...)
    hashes: list[str] = field(default_factory=list)  # the uploads the COPY steps take, in order
    descriptions: dict[str, str] = field(default_factory=dict)  # E2B's step -> what it does, for the logs
    runs: dict[str, tuple[str, str]] = field(default_factory=dict)  # a RUN step -> (its command, its user)


def escaped(value: str, what: str) -> str:
    """A value for the Dockerfile's words: no variable in it expands, and it stays on its line."""
    if "\n" in value or "\r" in value or "\0" in value:
        raise InvalidRequest(f"{what}: a line break or NUL byte in {value[:80]!r} is not supported")
    return value.replace("\\", "\\\\").replace("$", "\\$").replace('"', '\\"')


def _exec(*argv: str) -> str:
    return json.dumps(list(argv))


class _Writer:
    def __init__(self, build_id: str) -> None:
        self.lines: list[str] = []
        self.plan = Plan(dockerfile="")
        self.build_id = build_id
        self.user = DEFAULT_USER
        self.step = BASE_STEP

    def emit(self, line: str) -> None:
        self.lines.append(line)
        self.plan.steps[len(self.lines)] = self.step

    def as_user(self, user: str, line: str) -> None:
        """One instruction as ``user``, the current account again after it."""
        if user != self.user:
            self.emit(f"USER {user}")
        self.emit(line)
        if user != self.user:
            self.emit(f"USER {self.user}")

    def account(self, name: str) -> None:
        if name != ROOT:
            self.as_user(ROOT, "RUN " + _exec("/bin/sh", "-c", ACCOUNT_SCRIPT, "account", name))

    def force(self) -> None:
        self.emit(f"ARG {FORCE_ARG}={self.build_id}")


# the start command in the background, its output to a file; the ready command until it succeeds (at
# most READY_TIMEOUT seconds); then the start command is stopped (the builder sandbox ends after)
READY_TIMEOUT = 300
FINALIZE_SCRIPT = rf"""
log=/tmp/.e2b-start.log
if [ -n "$1" ]; then sh -c "$1" >"$log" 2>&1 </dev/null & pid=$!; fi
ready=${{2:-true}}
waited=0
until sh -c "$ready"; do
  if [ -n "$pid" ] && ! kill -0 "$pid" 2>/dev/null; then
    wait "$pid"; echo "the start command exited with status $? before the ready command succeeded:" >&2
    cat "$log" >&2; rm -f "$log"; exit 1
  fi
  waited=$((waited + 1))
  if [ "$waited" -ge {READY_TIMEOUT} ]; then
    echo "the ready command did not succeed in {READY_TIMEOUT} s" >&2; cat "$log" >&2 2>/dev/null; rm -f "$log"; exit 1
  fi
  sleep 1
done
[ -n "$pid" ] && kill "$pid" 2>/dev/null
rm -f "$log"
exit 0
"""


def plan(start: BuildStart, base: str, build_id: str, *, base_user: str | None = None) -> Plan:
    """The Dockerfile of a build on ``base`` (a dsec image). ``base_user``: the base is another E2B
    template, whose user (and workdir) the steps start from; None: E2B's defaults, ``user`` in /home/user."""
    w = _Writer(build_id)
    w.emit(f"FROM {base}")
    if start.force:
        w.force()
    if base_user is not None:
        w.user = base_user
    else:
        w.user = ROOT
        w.emit(f"USER {ROOT}")
        w.account(DEFAULT_USER)
        w.user = DEFAULT_USER
        w.emit(f"USER {DEFAULT_USER}")
        w.emit(f"WORKDIR /home/{DEFAULT_USER}")
    for index, step in enumerate(start.steps, start=1):
        w.step = str(index)
        w.plan.descriptions[w.step] = describe(step)
        if step.force:
            w.force()
        _step(w, step)
    if start.start_cmd or start.ready_cmd:
        w.step = FINALIZE_STEP
        w.plan.descriptions[w.step] = "start and ready commands"
        w.emit("RUN " + _exec("/bin/sh", "-c", FINALIZE_SCRIPT, "e2b", start.start_cmd or "", start.ready_cmd or ""))
        if start.start_cmd:
            w.emit("CMD " + _exec("/bin/sh", "-c", start.start_cmd))
    w.plan.dockerfile = "\n".join(w.lines) + "\n"
    return w.plan


def describe(step: Step) -> str:
    shown = " ".join(step.args)
    return f"{step.type} {shown[:200]}"


def _step(w: _Writer, step: Step) -> None:
    args = step.args
    if step.type == "RUN":
        if not args or not args[0].strip():
            raise InvalidRequest(f"step {w.step}: RUN needs a command")
        user = args[1] if len(args) > 1 and args[1] else w.user
        _check_owner(user, f"step {w.step}: RUN's user")
        w.plan.runs[w.step] = (args[0], user)
        w.as_user(user, "RUN " + _exec("/bin/sh", "-c", SHELL, "e2b", args[0]))
    elif step.type == "COPY":
        _copy(w, step)
    elif step.type == "WORKDIR":
        if len(args) != 1 or not args[0]:
            raise InvalidRequest(f"step {w.step}: WORKDIR takes one path")
        line = "WORKDIR " + escaped(args[0], f"step {w.step}: WORKDIR")
        w.as_user(ROOT, "RUN " + _exec("/bin/sh", "-c", WORKDIR_SCRIPT, "workdir", args[0], w.user))
        w.emit(line)
    elif step.type == "USER":
        if len(args) != 1 or not ACCOUNT.fullmatch(args[0]):
            raise InvalidRequest(f"step {w.step}: USER takes an account name (lower case, at most 32 characters)")
        w.account(args[0])
        w.user = args[0]
        w.emit(f"USER {args[0]}")
    else:  # ENV
        if len(args) % 2 or not args:
            raise InvalidRequest(f"step {w.step}: ENV takes names and values in pairs")
        for name, value in zip(args[::2], args[1::2], strict=True):
            if not ENV_NAME.fullmatch(name):
                raise InvalidRequest(f"step {w.step}: {name[:80]!r} is not a variable name")
            # ARG, not ENV: E2B's set_envs holds for the build's later steps, not for the sandboxes
            w.emit(f'ARG {name}="{escaped(value, f"step {w.step}: ENV {name}")}"')


def _check_owner(user: str, what: str) -> None:
    if not OWNER.fullmatch(user):
        raise InvalidRequest(f"{what} {user[:80]!r}: a name or id, with an optional :group")


def _copy(w: _Writer, step: Step) -> None:
    args = step.args + [""] * (4 - len(step.args))
    src, dest, owner, mode = args[:4]
    if not src or not dest:
        raise InvalidRequest(f"step {w.step}: COPY needs a source and a destination")
    if step.files_hash is None:
        raise InvalidRequest(f"step {w.step}: COPY names no filesHash (the SDK sends one for its upload)")
    clean = posixpath.normpath(src)
    if clean.startswith("/") or clean == ".." or clean.startswith("../"):
        raise InvalidRequest(f"step {w.step}: COPY's source {src[:80]!r} must be inside the build's context")
    flags = []
    chown = owner or (w.user if w.user != ROOT else "")
    if chown:
        _check_owner(chown, f"step {w.step}: COPY's user")
        flags.append(f"--chown={chown}")
    if mode:
        if not MODE.fullmatch(mode):
            raise InvalidRequest(f"step {w.step}: COPY's mode {mode[:20]!r} is not an octal mode")
        flags.append(f"--chmod={mode[-4:] if len(mode) > 3 else mode}")
    source = step.files_hash if clean == "." else f"{step.files_hash}/{clean}"
    what = f"step {w.step}: COPY"
    # a trailing / on the source's directory keeps Docker's rule: its contents go into the destination
    words = [escaped(source, what), escaped(dest, what)]
    w.plan.hashes.append(step.files_hash)
    w.emit(" ".join(["COPY", *flags, _exec(*words)]))
