"""Source code of a language (protocol/languages.py) compiled, then run, in a sandbox that exists: the
work under the SandboxFusion API's ``/run_code`` and one-shot runs of compiled languages.

Both steps go through the core's exec (the sandbox's limits, the audit of the caller's sandbox, its
output caps); each has its own time limit, and only the run gets standard input.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import InvalidRequest
from ..protocol.languages import LANGUAGES, CompileRunResult, Language, StepResult, StepStatus, supported
from ..protocol.run import RUN_DIR
from ..protocol.sandbox import DEFAULT_OUTPUT_CAP, ExecRequest, ExecResult
from ..tenancy import OPERATOR, Caller
from .files import FileActions
from .lifecycle import Lifecycle


def language(name: str) -> Language:
    """The language called ``name``; InvalidRequest naming the ones there are."""
    lang = LANGUAGES.get(name)
    if lang is None:
        raise InvalidRequest(f"language {name[:64]!r} is not supported (supported: {supported()})")
    return lang


async def compile_and_run(
    lifecycle: Lifecycle,
    files: FileActions,
    sandbox_id: str,
    language_name: str,
    code: str,
    *,
    stdin: str | None = None,
    compile_timeout: float = 10.0,
    run_timeout: float = 10.0,
    cwd: str = RUN_DIR,
    env: Mapping[str, str] | None = None,
    user: str | None = None,
    output_limit: int = DEFAULT_OUTPUT_CAP,
    caller: Caller = OPERATOR,
) -> CompileRunResult:
    """Write ``code`` to ``cwd``/<the language's source file> in the running sandbox ``sandbox_id``,
    compile it (if the language is compiled) within ``compile_timeout`` seconds, and, if that finished
    with exit status 0, run it within ``run_timeout`` seconds with ``stdin``.

    A program that fails, crashes or times out is a result (each step's ``status``, exit code, signal,
    output, duration); a step whose program is not in the image has status ``error``. Raises
    InvalidRequest for an unknown language, and the core's errors when the sandbox cannot be used (gone,
    not running, not the caller's). ``env`` is added to the image's environment (the language's own
    variables win), ``user`` runs both steps as that account of the image.
    """
    lang = language(language_name)
    rec = lifecycle.sandboxes.get(sandbox_id, caller)
    await files.write_file(sandbox_id, f"{cwd.rstrip('/')}/{lang.source}", code.encode(), caller=caller)
    step_env = {**(env or {}), **lang.env}

    async def step(argv: list[str], timeout: float, feed: str | None) -> StepResult:
        req = ExecRequest(
            cmd=argv, timeout=timeout, cwd=cwd, env=step_env, stdin=feed, user=user, output_limit=output_limit
        )
        return classify(await lifecycle.exec(sandbox_id, req, caller=caller), argv[0])

    result = CompileRunResult(language=lang.name)
    if lang.compile is not None:
        result.compile = await step(lang.argv(lang.compile, rec.limits.memory), compile_timeout, None)
        if result.compile.status != "finished" or result.compile.exit_code != 0:
            return result
    result.run = await step(lang.argv(lang.run, rec.limits.memory), run_timeout, stdin)
    return result


def classify(res: ExecResult, program: str) -> StepResult:
    """How a step ended. The sandbox agent answers a program it cannot find with exit status 127 and
    this message (kinds/container/agent.c, kinds/microvm/agent_exec.c)."""
    status: StepStatus
    if res.timed_out:
        status = "timeout"
    elif res.exit_code == 127 and res.stderr.startswith(f"dsec: cannot run {program}: "):
        status = "error"
    else:
        status = "finished"
    return StepResult(**res.model_dump(), status=status)
