"""A Python 3.12 virtualenv with Harbor and this checkout's dsec, as a Harbor user would have one.

Harbor needs Python 3.12 or newer and the suite runs on 3.11, so the Harbor tests make a virtualenv of
their own: ``pip install -c constraints-harbor.txt -e 'ROOT[harbor]'`` (dsec editable, with its
``harbor`` extra). It is kept under /var/tmp, keyed by the interpreter, the pins, pyproject.toml and the
checkout's path, and reused while they stay the same; making one takes a minute or more (its progress
is shown). A half-made one (an interrupted install) is made again. Only the absence of a Python
3.12 skips the tests, with the places looked in as the reason.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "constraints-harbor.txt"
PLACE = Path(os.environ.get("DSEC_HARBOR_VENVS", "/var/tmp"))
READY = ".dsec-ready"  # written last: a venv without it was not finished
INSTALL_TIMEOUT = 1500


Say = Callable[[str], None]


def to_stderr(message: str) -> None:
    print(f"[harbor venv] {message}", file=sys.stderr, flush=True)


def candidates() -> list[str]:
    """Where a Python 3.12 may be: $DSEC_PYTHON312, PATH, pyenv's versions, the usual prefixes."""
    found = [os.environ.get("DSEC_PYTHON312", ""), shutil.which("python3.12") or ""]
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    found += sorted(glob.glob(str(pyenv / "versions" / "3.12*" / "bin" / "python3.12")), reverse=True)
    found += ["/usr/bin/python3.12", "/usr/local/bin/python3.12"]
    return [c for c in dict.fromkeys(found) if c]


def find_python312() -> tuple[str | None, list[str]]:
    """A Python 3.12 that runs and has venv (a pyenv shim may exist for a version not selected), and
    the places looked in."""
    tried = candidates()
    for path in tried:
        try:
            done = subprocess.run(
                [path, "-c", "import sys, venv; print(sys.version_info[:2] == (3, 12))"],
                capture_output=True,
                text=True,
                timeout=60,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0 and done.stdout.strip() == "True":
            return path, tried
    return None, tried


def _key(python: str) -> str:
    version = subprocess.run([python, "-c", "import sys; print(sys.version)"], capture_output=True, text=True)
    digest = hashlib.sha256()
    for part in (version.stdout.encode(), CONSTRAINTS.read_bytes(), (ROOT / "pyproject.toml").read_bytes()):
        digest.update(hashlib.sha256(part).digest())
    digest.update(str(ROOT).encode())
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One maker at a time (another test run may be making the same venv)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _run(argv: list[str], what: str, say: Say) -> None:
    started = time.monotonic()
    say(f"{what} ...")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=INSTALL_TIMEOUT, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed ({done.returncode}): {(done.stdout + done.stderr)[-4000:]}")
    say(f"{what}: done in {time.monotonic() - started:.0f} s")


def _forget_older(keep: Path) -> None:
    """Venvs this checkout made from older pins: each holds a few hundred MB."""
    for other in PLACE.glob("dsec-harbor-venv-*"):
        if other == keep or other.suffix == ".lock" or not other.is_dir():
            continue
        try:
            if (other / ".dsec-root").read_text() == str(ROOT):
                shutil.rmtree(other, ignore_errors=True)
        except OSError:
            continue


def harbor_venv(python: str, say: Say = to_stderr) -> Path:
    """The venv (made now if there is none for these pins): ``bin/harbor``, ``bin/python``. ``say`` shows
    progress: making one takes long enough that a silent wait would look like a hang."""
    venv = PLACE / f"dsec-harbor-venv-{_key(python)}"
    with _locked(venv.with_suffix(".lock")):
        if (venv / READY).exists():
            say(f"reusing {venv}")
            return venv
        shutil.rmtree(venv, ignore_errors=True)
        say(f"making {venv} with {python} (Harbor and dsec from {ROOT}; this takes a minute or more)")
        _run([python, "-m", "venv", str(venv)], "python3.12 -m venv", say)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        _run([*pip, "-c", str(CONSTRAINTS), "-e", f"{ROOT}[harbor]"], "pip install -e '.[harbor]'", say)
        (venv / ".dsec-root").write_text(str(ROOT))
        (venv / READY).write_text(time.strftime("%Y-%m-%dT%H:%M:%S"))
    _forget_older(venv)
    return venv
