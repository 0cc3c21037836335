"""API fuzzing with schemathesis, run from pytest: every operation of an OpenAPI document, in positive and
negative mode, a bounded and derandomized number of examples each, against a live server; every response
judged by schemathesis's checks. Used by test_api_fuzz.py (node API, E2B control API, cluster gateway).

``DSEC_FUZZ_EXAMPLES`` (default 10) sets the examples per operation and mode; ``DSEC_FUZZ_COVERAGE=1``
runs schemathesis's whole coverage phase on every API (a few thousand deterministic cases each: minutes;
by default only the node API's positive boundary cases);
``DSEC_FUZZ_VM=1`` lets the cases create microvm and vm sandboxes too (slow under TCG: the default keeps
to container and function); ``DSEC_FUZZ_REPORT`` names a file the figures are also written to, as JSON
(docs/reliability.md "API fuzzing").
"""

from __future__ import annotations

import json
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import Case, GenerationMode, Response
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import Failure, FailureGroup
from schemathesis.generation.drivers import CoverageGenerator
from schemathesis.generation.feedback import FeedbackSources
from schemathesis.generation.overrides import Override
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    positive_data_acceptance,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)

EXAMPLES = int(os.environ.get("DSEC_FUZZ_EXAMPLES", "10"))
WITH_VMS = os.environ.get("DSEC_FUZZ_VM", "") == "1"
REPORT = os.environ.get("DSEC_FUZZ_REPORT")
COVERAGE = os.environ.get("DSEC_FUZZ_COVERAGE", "") == "1"
POSITIVE, NEGATIVE = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
BOTH = (POSITIVE, NEGATIVE)
TIMEOUT = 60.0  # seconds a request may take
# What must hold for every response: no 5xx, only documented statuses, bodies (errors included) as
# documented, content types as documented (and, for a method a path does not have, a 405 with Allow).
STRICT: dict[str, Any] = {
    "not_a_server_error": not_a_server_error,
    "status_code_conformance": status_code_conformance,
    "content_type_conformance": content_type_conformance,
    "response_schema_conformance": response_schema_conformance,
}
# Counted and reported, not asserted: a request refused although its schema allows it (a rule the
# schema cannot state: across fields, or on the state of the sandbox), or one accepted although its
# schema does not (the daemon is lenient: '512Mi' for a size, an epoch for a time).
MEASURED: dict[str, Any] = {
    "positive_data_acceptance": positive_data_acceptance,
    "negative_data_rejection": negative_data_rejection,
}
# tar archives (uploads, build contexts) are sent as the raw bytes generated for them
schemathesis.serializer.alias("application/x-tar", "application/octet-stream")
MAKERS = ("POST", "PUT")  # the methods that make sandboxes, images, trajectories and tenants
SANDBOX_ID = re.compile(r"\bsb-[0-9a-f]{12}\b")
TARGET = "sandbox_id"  # the path parameter that names the live sandbox in every other positive case
# small bounds on what one case may ask the node for, so a run fits a 2-core test machine: counts of
# sandboxes and runs, and every timeout (TTL, exec, queue), in positive cases only (a negative case
# stays as generated: invalid on purpose)
SMALL = {"count": 2, "n": 2, "concurrency": 4, "timeout": 10.0, "idle_timeout": 10.0, "queue_timeout": 1.0}
MAX_RUNS = 2
STREAMS_OPEN = ("/execs/live",)  # answers that stay open until the request's timeout (Server-Sent Events)


@dataclass
class Tally:
    """What one fuzzing run sent and how the answers fared."""

    api: str
    operations: list[str] = field(default_factory=list)
    requests: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    failures: dict[str, list[str]] = field(default_factory=dict)  # check -> "OPERATION: message" samples
    failed: Counter[str] = field(default_factory=Counter)  # check -> failing responses
    failed_by_operation: dict[str, Counter[str]] = field(default_factory=dict)  # check -> operation -> count
    per_operation: Counter[str] = field(default_factory=Counter)
    answers: dict[str, Counter[int]] = field(default_factory=dict)  # operation -> statuses
    accepted: set[str] = field(default_factory=set)  # every string of a 2xx answer to a POST or PUT
    seconds: float = 0.0

    def record(self, check: str, operation: str, failure: Failure, response: Response) -> None:
        self.failed[check] += 1
        self.failed_by_operation.setdefault(check, Counter())[operation] += 1
        samples = self.failures.setdefault(check, [])
        answer = (response.content or b"")[:300].decode(errors="replace")
        why = " ".join(failure.message.split())[:200]
        body = response.request.body
        sent = (body if isinstance(body, bytes) else str(body or "").encode())[:600].decode(errors="replace")
        line = f"{operation}: {failure.title} ({why}); sent {str(response.request.url)[:300]} {sent}; answered "
        line += f"{response.status_code} {answer}"
        if len(samples) < 20 and line not in samples:
            samples.append(line)

    def strict_failures(self) -> dict[str, list[str]]:
        return {c: s for c, s in self.failures.items() if c in STRICT or c == "unsupported_method"}

    def summary(self) -> str:
        lines = [
            f"{self.api}: {len(self.operations)} operations, {self.requests} requests in {self.seconds:.1f} s",
            f"  statuses: {dict(sorted(self.statuses.items()))}",
            f"  failing responses by check: {dict(self.failed) or 'none'}",
        ]
        for check, samples in self.failures.items():
            lines.append(f"  {check}:")
            lines += [f"    {s}" for s in samples[:8]]
        return "\n".join(lines)

    def save(self) -> None:
        if not REPORT:
            return
        data = json.loads(open(REPORT).read()) if os.path.exists(REPORT) else {}
        data[self.api] = {
            "examples": EXAMPLES,
            "operations": len(self.operations),
            "requests": self.requests,
            "seconds": round(self.seconds, 1),
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
            "failed": dict(self.failed),
            "failed_by_operation": {c: dict(ops.most_common()) for c, ops in self.failed_by_operation.items()},
            "samples": self.failures,
            "answers": {op: {str(k): v for k, v in sorted(c.items())} for op, c in self.answers.items()},
        }
        with open(REPORT, "w") as f:
            json.dump(data, f, indent=1)


def load(document: dict[str, Any]) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_dict(document, config=schemathesis.Config())


def strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from strings(v)


def body_strings(response: Response) -> set[str]:
    """Every string in a JSON (or NDJSON) body, and every sandbox id in any body."""
    text = (response.content or b"").decode(errors="replace")
    found = set(SANDBOX_ID.findall(text))
    ndjson = "ndjson" in "".join(response.headers.get("content-type", []))
    for line in text.splitlines() if ndjson else [text]:
        try:
            found.update(strings(json.loads(line)))
        except ValueError:
            continue
    return found


def make_small(value: Any, key: str = "") -> Any:
    """A positive case's body with its counts and timeouts bounded (see SMALL), and without VM kinds
    unless DSEC_FUZZ_VM=1."""
    if isinstance(value, dict):
        out = {k: make_small(v, k) for k, v in value.items()}
        if not WITH_VMS:
            if out.get("kind") in ("microvm", "vm"):
                out["kind"] = "container"
            meta = out.get("metadata")
            if isinstance(meta, dict) and meta.get("dsec.kind") in ("microvm", "vm"):
                meta["dsec.kind"] = "container"
            template = out.get("templateID")
            if isinstance(template, str) and template.endswith(("@microvm", "@vm")):
                out["templateID"] = template.rpartition("@")[0] or "base"
        return out
    if isinstance(value, list):
        items = [make_small(v) for v in value]
        return items[:MAX_RUNS] if key == "runs" else items
    bound = SMALL.get(key)
    if bound is not None and isinstance(value, int | float) and not isinstance(value, bool) and value > bound:
        return type(value)(bound)
    return value


def _prepare(case: Case[Any], on: str | None) -> None:
    """``on``: the live target's id, for the case's path parameter ``TARGET`` names."""
    if on is not None and case.path_parameters is not None:
        case.path_parameters = {**case.path_parameters, TARGET: on}
        if case.path.endswith(STREAMS_OPEN):  # open until its timeout, with keepalives: keep each one short
            case.query = {**(case.query or {}), "timeout": 1}
    mode = case.meta.generation.mode if case.meta is not None else GenerationMode.POSITIVE
    if mode == GenerationMode.POSITIVE and isinstance(case.body, dict | list):
        case.body = make_small(case.body)
    if mode == GenerationMode.POSITIVE and isinstance(case.query, dict):
        case.query = make_small(case.query)


def fuzz(
    api: str,
    schema: schemathesis.BaseSchema,
    base_url: str,
    headers: dict[str, str],
    *,
    target: Callable[[], str] | None = None,
    after: Callable[[Case[Any], Response, set[str]], None] | None = None,
    coverage: tuple[GenerationMode, ...] = (),
) -> Tally:
    """Every operation of ``schema``: EXAMPLES generated cases per mode (the path parameter TARGET the live
    sandbox ``target()`` answers in every other positive case), then schemathesis's coverage cases of the
    ``coverage`` modes (both with COVERAGE): positive ones are the boundaries (longest strings, largest
    numbers, ...), negative ones each kind of invalid value and undocumented methods. ``after`` sees each
    answered case with the strings of an accepted POST's or PUT's answer (to undo what it made)."""
    judge = Judge(Tally(api), base_url, headers, after)
    started = time.monotonic()
    for result in schema.get_all_operations():
        op = result.ok()  # type: ignore[union-attr]  # an invalid document fails here, as it should
        label = f"{op.method.upper()} {op.path}"
        judge.tally.operations.append(label)
        names = {p.name for p in op.path_parameters}
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            aim = target if TARGET in names and mode == GenerationMode.POSITIVE else None
            _generated(judge, label, op.as_strategy(generation_mode=mode), aim)
        for case in _coverage_cases(op, BOTH if COVERAGE else coverage):
            judge(label, case)
    judge.tally.seconds = time.monotonic() - started
    judge.tally.save()
    return judge.tally


@dataclass
class Judge:
    """Sends a case and has its answer judged by every check; failures are collected, not raised."""

    tally: Tally
    base_url: str
    headers: dict[str, str]
    after: Callable[[Case[Any], Response, set[str]], None] | None
    session: requests.Session = field(default_factory=requests.Session)

    def __call__(self, label: str, case: Case[Any]) -> None:
        tally = self.tally
        response = case.call(base_url=self.base_url, session=self.session, headers=self.headers, timeout=TIMEOUT)
        tally.requests += 1
        tally.per_operation[label] += 1
        tally.answers.setdefault(label, Counter())[response.status_code] += 1
        tally.statuses[response.status_code] += 1
        # what an accepted POST or PUT answered may be what it made; a list's answer names what others made
        made = body_strings(response) if 200 <= response.status_code < 300 and case.method in MAKERS else set()
        tally.accepted |= made
        # a method the path does not have: a 405 that says which it has, and nothing else to judge
        checks = {"unsupported_method": unsupported_method} if case.method != label.split()[0] else STRICT | MEASURED
        for name, check in checks.items():
            try:
                case.validate_response(response, checks=[check], headers=self.headers)
            except FailureGroup as group:
                for failure in group.exceptions:
                    tally.record(name, label, failure, response)
        if self.after is not None:
            self.after(case, response, made)


def _generated(judge: Judge, label: str, strategy: Any, target: Callable[[], str] | None) -> None:
    cases = 0

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: failures are collected, not raised
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def one(case: Case[Any]) -> None:
        nonlocal cases
        cases += 1
        _prepare(case, target() if target is not None and cases % 2 else None)
        judge(label, case)

    try:
        one()
    except Unsatisfiable:
        pass  # nothing to make invalid (an operation without parameters or body, in negative mode)


def _coverage_cases(op: Any, modes: tuple[GenerationMode, ...]) -> Iterator[Case[Any]]:
    if not modes:
        return
    config = op.schema.config.generation_for(operation=op, phase="coverage")
    generator = CoverageGenerator(
        operation=op,
        generation_modes=list(modes),
        generation_config=config,
        auth_storage=None,
        override=Override(),
        feedback=FeedbackSources(),
        hooks=None,
    )
    for case in generator:
        _prepare(case, None)
        yield case
