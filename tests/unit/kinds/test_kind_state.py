"""The kinds' typed views of their state in a record: what they store is what a restarted daemon (or an
older one's state database) reads back, under the same keys."""

from __future__ import annotations

from pathlib import Path

from dsec.kinds.container.state import ContainerState
from dsec.kinds.function.state import FunctionState
from dsec.kinds.microvm.state import VMState
from dsec.kinds.state import KindState
from dsec.protocol.sandbox import Limits, State
from dsec.store.records import SandboxRecord
from dsec.store.sqlite import SandboxStore


def _rec(sid: str = "sb-1") -> SandboxRecord:
    return SandboxRecord(
        id=sid, kind="container", image="i", state=State.running, created_at=1, expires_at=2, limits=Limits()
    )


def _round_trip(rec: SandboxRecord, tmp_path: Path) -> SandboxRecord:
    store = SandboxStore(tmp_path / "state.db")
    try:
        store.put(rec)
        got = store.get(rec.id)
    finally:
        store.close()
    assert got is not None
    return got


def test_a_containers_state_survives_its_record(tmp_path: Path) -> None:
    rec = _rec()
    st = ContainerState(rec)
    st.init, st.uid_base, st.user, st.cwd = "agent", 100000, (1000, 1000), "/work"
    st.env["HOME"] = "/home/u"
    st.joined(3, 7)
    got = ContainerState(_round_trip(rec, tmp_path))
    assert (got.init, got.uid_base, got.user, got.cwd, got.env) == (
        "agent",
        100000,
        (1000, 1000),
        "/work",
        {"HOME": "/home/u"},
    )
    assert (got.net_index, got.net_gen, got.worker) == (3, 7, False)


def test_a_workers_ready_group_is_taken_once() -> None:
    rec = _rec()
    st = ContainerState(rec)
    st.mark_worker()
    st.ready("exec-1")
    assert st.worker and st.take_ready() == "exec-1" and st.take_ready() is None


def test_unknown_or_damaged_values_read_as_absent() -> None:
    rec = _rec()
    rec.runtime.update({"init": "x", "uid_base": True, "user": "root", "net_index": "3", "worker": "yes"})
    st = ContainerState(rec)
    assert (st.init, st.uid_base, st.user, st.net_index, st.worker) == ("catatonit", None, None, None, False)


def test_a_vm_copy_inherits_its_parents_environment_not_its_qemu(tmp_path: Path) -> None:
    parent, child = _rec("sb-p"), _rec("sb-c")
    p = VMState(parent)
    p.env, p.cwd, p.user_spec, p.user, p.pid = {"A": "1"}, "/srv", "app", (5, 5), 4242
    p.shape = {"memory_mib": 256, "cpus": 1, "layers": []}
    c = VMState(child)
    c.inherit(p)
    assert (c.env, c.cwd, c.user_spec, c.user, c.pid, c.shape) == ({"A": "1"}, "/srv", "app", (5, 5), None, None)
    c.env["B"] = "2"
    assert p.env == {"A": "1"}  # a copy's environment is its own
    assert VMState(_round_trip(parent, tmp_path)).shape == {"memory_mib": 256, "cpus": 1, "layers": []}


def test_a_function_sandbox_keeps_its_lent_worker_for_a_restart(tmp_path: Path) -> None:
    worker, rec = _rec("fw-1"), _rec("sb-f")
    worker.network = "full"
    ContainerState(worker).uid_base = 200000
    FunctionState(rec).lent(worker, True, ("t", "img", "256", "full"))
    ContainerState(worker).joined(2, 1)  # changed after lending: stored with the sandbox too
    got = FunctionState(_round_trip(rec, tmp_path))
    assert got.warm and got.pool == ("t", "img", "256", "full")
    adopted = got.adopted_worker(Limits())
    assert adopted is not None and adopted.id == "fw-1" and adopted.network == "full"
    assert ContainerState(adopted).uid_base == 200000 and KindState(adopted).net_index == 2


def test_an_exec_as_another_account_gets_its_home_unless_home_was_given(tmp_path: Path) -> None:
    rec = _rec()
    state = KindState(rec)
    assert state.home_for({}, "/home/agent") == {"HOME": "/home/agent"}  # docker exec -u's HOME
    assert state.home_for({"HOME": "/mine"}, "/home/agent") == {}  # the call's own wins
    state.home_given = True  # the image or the sandbox set HOME: every exec keeps it
    assert state.home_for({}, "/home/agent") == {}
    assert KindState(_round_trip(rec, tmp_path)).home_given  # a restarted daemon reads it back
