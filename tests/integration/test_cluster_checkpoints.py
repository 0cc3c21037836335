"""Checkpoints, rollbacks and a container's fork through the cluster gateway: two real node daemons behind
``dsec cluster gateway``; the copies are found on their parent's node afterwards, by id, through it."""

from __future__ import annotations

import dsec

from .static_cluster import static_cluster


def test_checkpoint_rollback_and_fork_through_the_gateway() -> None:
    with static_cluster("dsec-ckpt-cluster-") as cluster:
        client = cluster.client()
        sb = dsec.Sandbox.create(image="dsec/busybox", client=client)
        try:
            sb.exec("echo prepared > /state")
            c1 = sb.checkpoint("prepared")
            assert [c.id for c in sb.checkpoints()] == [c1.id]
            sb.exec("echo stepped > /state")
            sb.rollback("prepared")
            assert sb.exec("cat /state").stdout == "prepared\n"
            copies = sb.fork(2, checkpoint=c1)
            assert len(copies) == 2 and not copies.failed
            node = sb.info().node
            for c in copies:
                again = dsec.Sandbox.connect(c.id, client=client)  # the gateway knows where it is
                assert again.info().node == node
                assert again.exec("cat /state").stdout == "prepared\n"
                again.kill()
            sb.remove_checkpoint(c1)
            assert sb.checkpoints() == []
        finally:
            sb.kill()
