"""The e2b-code-interpreter package through a cluster's gateway: the gateway passes port 49999's calls to
the sandbox's node like any port's, and the node's E2B listener answers them from its code contexts."""

from __future__ import annotations

import pytest

from dsec.e2b.code_interpreter import IMAGE

from .static_cluster import static_cluster

pytest.importorskip("e2b")
e2b_ci = pytest.importorskip("e2b_code_interpreter")
from e2b_code_interpreter import Sandbox  # noqa: E402

pytestmark = pytest.mark.timeout(900)


def test_run_code_through_the_gateway() -> None:
    with static_cluster("dsec-e2b-ci-cluster-") as cluster:
        assert cluster.client().build_image(IMAGE).ready  # on the shared repository: each node finds it
        with Sandbox.create(timeout=300, **cluster.opts()) as box:
            assert box.run_code("n = 41").error is None
            seen: list[str] = []
            done = box.run_code("print('via the gateway')\nn + 1", on_stdout=lambda m: seen.append(m.line))
            assert (done.text, seen) == ("42", ["via the gateway\n"])
            ctx = box.create_code_context(cwd="/tmp")
            assert box.run_code("import os\nos.getcwd()", context=ctx).text == "/tmp"
            assert ctx.id in [c.id for c in box.list_code_contexts()]
