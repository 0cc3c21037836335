"""Harbor (0.25, the Terminal-Bench 2.0 harness) with its trials in dsec sandboxes:

    HARBOR_TELEMETRY=0 harbor run -p ./task -a oracle -e dsec.integrations.harbor:DsecEnvironment

``DsecEnvironment`` builds the task's ``environment/Dockerfile`` on the dsec node (or pulls its
``[environment].docker_image``) and runs the trial in a sandbox of it, with Harbor's /logs, /tests and
/solution conventions and the task's resources and network policy. The daemon is ``DSEC_URL`` with
``DSEC_TOKEN``; ``--ek KEY=VALUE`` sets dsec's own options (see ``options.py``).

Needs the ``harbor`` extra, in Python 3.12 or newer (Harbor's own floor): ``pip install 'dsec[harbor]'``.
``DsecEnvironment`` is imported on first use, so ``mapping`` and ``options`` load without Harbor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .environment import DsecEnvironment

__all__ = ["DsecEnvironment"]


def __getattr__(name: str) -> object:
    if name == "DsecEnvironment":
        from .environment import DsecEnvironment

        return DsecEnvironment
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
