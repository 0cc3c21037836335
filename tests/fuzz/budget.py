"""How much each parser fuzz target runs, and the checks every target shares.

By default (``make test``, CI) each target runs a fixed, derandomized number of examples: the same
inputs on every run, so a red run is reproducible and the suite's time is stable (about a minute for
all targets on a 2-core machine). ``DSEC_FUZZ_EXAMPLES=N`` makes every target run N random examples
instead, with Hypothesis's example database (``.hypothesis/``) on, so that a failure found by a long
run is replayed first by the next one (docs/reliability.md, "Parser fuzzing")::

    DSEC_FUZZ_EXAMPLES=5000 pytest -q -o timeout=2400 --hypothesis-show-statistics tests/fuzz

A failure prints the minimal input; pin it with ``@example`` beside the fix.
"""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Iterator
from datetime import timedelta

from hypothesis import HealthCheck, currently_in_test_context, event, settings

EXAMPLES_ENV = "DSEC_FUZZ_EXAMPLES"

settings.register_profile(
    "dsec-fuzz-ci",
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dsec-fuzz-long",
    derandomize=False,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def long_run_examples() -> int | None:
    raw = os.environ.get(EXAMPLES_ENV, "").strip()
    return int(raw) if raw else None


# One example may take this long: far above any target's typical few milliseconds, so a parser that goes
# quadratic on some input fails the run, yet a stall of the shared 2-core machine does not. A true hang
# is ended by the test's pytest-timeout.
DEADLINE = timedelta(seconds=10)


def fuzz(examples: int, *, fixtures: bool = False) -> settings:
    """Settings for one target: ``examples`` per run by default (sized so that all targets together
    take about a minute), or DSEC_FUZZ_EXAMPLES. ``fixtures``: the test uses a function-scoped fixture
    that holds no state one example could leave for the next."""
    override = long_run_examples()
    parent = settings.get_profile("dsec-fuzz-long" if override else "dsec-fuzz-ci")
    checks = list(parent.suppress_health_check)
    if fixtures:
        checks.append(HealthCheck.function_scoped_fixture)
    return settings(
        parent,
        max_examples=override or examples,
        deadline=DEADLINE,
        suppress_health_check=checks,
    )


def outcome(what: str) -> None:
    """Count an outcome for ``--hypothesis-show-statistics`` (how many inputs got how deep)."""
    if currently_in_test_context():
        event(what)


def _vm_size() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


@contextlib.contextmanager
def bounded_file_size(limit: int = 256 << 20) -> Iterator[None]:
    """Files written inside may not grow past ``limit`` bytes (EFBIG; Python ignores SIGXFSZ): an
    extractor that expands a few bytes of archive into gigabytes fails fast instead of filling the disk."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (min(limit, hard) if hard != resource.RLIM_INFINITY else limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


@contextlib.contextmanager
def bounded_memory(extra: int = 512 << 20) -> Iterator[None]:
    """Let the code inside grow the process by at most ``extra`` bytes of address space: a parser that
    believes a length it was given and allocates it fails with MemoryError (which no target accepts)
    instead of taking the machine's memory. Only around pure-Python code: a Rust or C extension may
    abort the process on a failed allocation."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _vm_size() + extra
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
