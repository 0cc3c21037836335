"""The layers hold at run time too: what the daemon's modules load, and what the wire contract loads."""

from __future__ import annotations

import json
import subprocess
import sys

import dsec


def _loaded(*modules: str) -> list[str]:
    code = f"import json, sys\nimport {', '.join(modules)}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return [m for m in json.loads(out.stdout) if m == "dsec" or m.startswith("dsec.")]


def test_the_daemon_never_loads_the_client() -> None:
    loaded = _loaded("dsec.daemon", "dsec.server.app", "dsec.e2b.app", "dsec.cluster.gateway", "dsec.core.manager")
    assert "dsec.server.app" in loaded
    assert [m for m in loaded if m.startswith("dsec.sdk")] == []


def test_the_wire_contract_loads_only_errors_and_units() -> None:
    loaded = _loaded("dsec.protocol.sandbox", "dsec.protocol.node", "dsec.protocol.run", "dsec.protocol.trajectory")
    outside = [m for m in loaded if not m.startswith("dsec.protocol")]
    assert outside == ["dsec", "dsec.errors", "dsec.units"]


def test_the_public_names_still_come_from_dsec() -> None:
    for name in dsec.__all__:
        assert getattr(dsec, name) is not None, name
    assert dsec.Sandbox.__name__ == "Sandbox" and dsec.AsyncClient.__module__ == "dsec.sdk.aio"
