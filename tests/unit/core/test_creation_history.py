"""The last hour of creations by minute: counted per kind and failure reason, one even axis of 60
minutes, each tenant seeing only its own; and a cluster's nodes added minute by minute."""

from __future__ import annotations

from dsec.cluster.aggregate import history_total
from dsec.core.history import CreationHistory
from dsec.tenancy import OPERATOR, Caller


def test_buckets_count_per_minute_and_keep_an_hour() -> None:
    now = [7200.0]
    h = CreationHistory(clock=lambda: now[0])
    h.created("container", None)
    h.created("container", "alice")
    h.failed("overloaded", "alice")
    now[0] += 61
    h.created("vm", "bob")
    view = h.view(OPERATOR)
    assert view.step_s == 60 and len(view.buckets) == 60
    assert [b.at for b in view.buckets] == list(range(7260 - 59 * 60, 7261, 60))
    assert view.buckets[-2].created == {"container": 2} and view.buckets[-2].failed == {"overloaded": 1}
    assert view.buckets[-1].created == {"vm": 1}
    alice = h.view(Caller("alice"))
    assert alice.buckets[-2].created == {"container": 1} and alice.buckets[-1].created == {}
    now[0] += 3600  # an hour later everything has aged out
    assert all(not b.created and not b.failed for b in h.view(OPERATOR).buckets)


def test_a_clusters_history_adds_its_nodes_minute_by_minute() -> None:
    a = CreationHistory(clock=lambda: 600.0)
    b = CreationHistory(clock=lambda: 600.0)
    a.created("container", None)
    b.created("container", None)
    b.failed("image_not_found", None)
    total = history_total([a.view(OPERATOR), b.view(OPERATOR)])
    assert len(total.buckets) == 60
    assert total.buckets[-1].created == {"container": 2} and total.buckets[-1].failed == {"image_not_found": 1}
    assert history_total([]).buckets == []
