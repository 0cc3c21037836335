"""``sb.run_code``: Python cells run in a context that keeps its variables (a Jupyter kernel in the sandbox
where the image has one). A part of ``AsyncSandbox``."""

from __future__ import annotations

import builtins

from ..errors import InvalidRequest, validation_message
from ..protocol.code import CodeContexts, CodeRequest, CodeResult
from ..protocol.sandbox import MAX_EXEC_TIMEOUT_S
from .transport import Transport

START_ALLOWANCE = 300.0  # a context's first call starts its kernel (tens of seconds under emulation)


class CodeMixin:
    @property
    def id(self) -> str:
        raise NotImplementedError

    @property
    def _t(self) -> Transport:
        raise NotImplementedError

    async def run_code(
        self, code: str, language: str = "python", context: str | None = None, timeout: float = 60.0
    ) -> CodeResult:
        """Run ``code`` in a context whose variables survive between calls (``context`` names a separate one;
        default ``'default'``). Returns stdout, stderr, the last expression's value (``result``, ``.text``),
        rich displays (``outputs``, ``.images`` for matplotlib PNGs) and the code's error, if any
        (``error.name``, ``.value``, ``.traceback``: not raised). ``timeout`` interrupts the code and keeps
        the context. Needs ``python3`` in the image; ``dsec/code:1`` has a Jupyter kernel with numpy,
        pandas and matplotlib, other images get a plain interpreter. Another ``language`` (cpp, c, go,
        java, nodejs, bash, sh) is compiled and run once, keeping nothing (``context`` must be None)."""
        body = {"code": code, "language": language, "context": context, "timeout": timeout}
        try:
            CodeRequest.model_validate(body)
        except ValueError as e:
            raise InvalidRequest(validation_message(e)) from None
        http_timeout = min(timeout, MAX_EXEC_TIMEOUT_S) + START_ALLOWANCE
        reply = await self._t.request("POST", f"/v1/sandboxes/{self.id}/code", json=body, timeout=http_timeout)
        return CodeResult.model_validate_json(reply.content)

    async def code_contexts(self) -> builtins.list[str]:
        """The code contexts running in the sandbox."""
        reply = await self._t.request("GET", f"/v1/sandboxes/{self.id}/code/contexts")
        return CodeContexts.model_validate_json(reply.content).contexts

    async def remove_code_context(self, context: str) -> None:
        """Stop a context's interpreter: its variables are gone (the name can be used again, afresh)."""
        await self._t.request("DELETE", f"/v1/sandboxes/{self.id}/code/contexts/{context}")
