"""The envd message models speak proto3 JSON as the e2b SDK's own protobuf classes do, in both directions."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from pydantic import ValidationError

from dsec.e2b.envd_models import (
    PTY,
    CreateWatcherRequest,
    CreateWatcherResponse,
    DataEvent,
    EndEvent,
    EntryInfo,
    EventType,
    FilesystemEvent,
    FileType,
    GetWatcherEventsRequest,
    GetWatcherEventsResponse,
    KeepAlive,
    ListDirRequest,
    ListDirResponse,
    ListResponse,
    MoveRequest,
    ProcessConfig,
    ProcessEvent,
    ProcessInfo,
    ProcessInput,
    ProcessSelector,
    PTYSize,
    SendInputRequest,
    SendSignalRequest,
    Signal,
    StartEvent,
    StartRequest,
    StartResponse,
    StatResponse,
    StreamInputRequest,
    UpdateRequest,
    WatchDirRequest,
    WatchDirResponse,
    WatchDirStart,
    timestamp_from_ns,
)

WHEN = datetime(2026, 12, 4, 3, 27, 2, 773869, tzinfo=UTC)
BIG = 2**53 + 1  # a size a JavaScript number would round


def wire(model: Any) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(model.to_wire())
    return out


# -- the JSON mapping ------------------------------------------------------------------------------------------------


def test_camel_case_out_and_both_spellings_in() -> None:
    end = EndEvent(exit_code=-1, exited=True, status="exit status 255", error="boom")
    assert wire(end) == {"exitCode": -1, "exited": True, "status": "exit status 255", "error": "boom"}
    assert EndEvent.model_validate_json('{"exitCode": 3}').exit_code == 3
    assert EndEvent.model_validate_json('{"exit_code": 3}').exit_code == 3
    assert CreateWatcherResponse.model_validate_json('{"watcher_id": "w"}').watcher_id == "w"
    assert wire(CreateWatcherResponse(watcher_id="w")) == {"watcherId": "w"}


@pytest.mark.parametrize("text", ["aGn/+w==", "aGn/+w", "aGn_-w==", "aGn_-w"])
def test_bytes_accept_both_alphabets_with_or_without_padding(text: str) -> None:
    assert ProcessInput.model_validate({"stdin": text}).stdin == b"hi\xff\xfb"


def test_bytes_output_standard_padded() -> None:
    assert wire(DataEvent(stdout=b"hi\xff\xfb")) == {"stdout": "aGn/+w=="}
    assert wire(DataEvent(stderr=b"")) == {"stderr": ""}  # set but empty is still set


@pytest.mark.parametrize("text", ["a", "aGk!", "aGk=x"])
def test_bad_base64(text: str) -> None:
    with pytest.raises(ValidationError, match="base64"):
        ProcessInput.model_validate({"stdin": text})


def test_int64_is_a_string_out_and_either_in() -> None:
    assert wire(EntryInfo(size=BIG))["size"] == str(BIG)
    assert EntryInfo.model_validate({"size": str(BIG)}).size == BIG
    assert EntryInfo.model_validate({"size": 12}).size == 12
    assert EntryInfo.model_validate({"size": "-3"}).size == -3
    with pytest.raises(ValidationError, match="out of range"):
        EntryInfo.model_validate({"size": str(2**63)})


def test_32_bit_ints() -> None:
    assert wire(StartEvent(pid=7)) == {"pid": 7}
    assert StartEvent.model_validate({"pid": "7"}).pid == 7
    assert StartEvent.model_validate({"pid": 7.0}).pid == 7
    assert StartEvent.model_validate({"pid": "1e3"}).pid == 1000
    assert EndEvent.model_validate({"exitCode": "-2"}).exit_code == -2
    for bad in (-1, 2**32, "1.5", True, "1e999999999", "seven"):
        with pytest.raises(ValidationError):
            StartEvent.model_validate({"pid": bad})


def test_enums_by_name_or_number() -> None:
    assert wire(SendSignalRequest(signal=Signal.SIGNAL_SIGKILL))["signal"] == "SIGNAL_SIGKILL"
    assert SendSignalRequest.model_validate({"signal": "SIGNAL_SIGTERM"}).signal is Signal.SIGNAL_SIGTERM
    assert SendSignalRequest.model_validate({"signal": 9}).signal is Signal.SIGNAL_SIGKILL
    assert FilesystemEvent.model_validate({"type": 4}).type is EventType.EVENT_TYPE_RENAME
    # values from a newer proto map to UNSPECIFIED rather than failing
    assert SendSignalRequest.model_validate({"signal": 2}).signal is Signal.SIGNAL_UNSPECIFIED
    assert EntryInfo.model_validate({"type": "FILE_TYPE_SOCKET"}).type is FileType.FILE_TYPE_UNSPECIFIED
    with pytest.raises(ValidationError):
        SendSignalRequest.model_validate({"signal": True})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2026-12-04T03:27:02.773869Z", WHEN),
        ("2026-12-04T03:27:02.773869123Z", WHEN),
        ("2026-12-04t04:27:02.773869+01:00", WHEN),
        ("2026-12-03T22:57:02.773869-04:30", WHEN),
        ("2026-12-04T03:27:02Z", WHEN.replace(microsecond=0)),
        ("2026-12-04T03:27:02.5z", WHEN.replace(microsecond=500000)),
    ],
)
def test_timestamp_in(text: str, expected: datetime) -> None:
    parsed = EntryInfo.model_validate({"modifiedTime": text}).modified_time
    assert parsed == expected and parsed is not None and parsed.tzinfo is UTC


@pytest.mark.parametrize(
    ("when", "text"),
    [
        (WHEN, "2026-12-04T03:27:02.773869Z"),
        (WHEN.replace(microsecond=0), "2026-12-04T03:27:02Z"),
        (WHEN.replace(microsecond=120000), "2026-12-04T03:27:02.120Z"),
        (WHEN.astimezone(timezone(timedelta(hours=5))), "2026-12-04T03:27:02.773869Z"),
        (datetime(5, 1, 2, tzinfo=UTC), "0005-01-02T00:00:00Z"),
    ],
)
def test_timestamp_out(when: datetime, text: str) -> None:
    assert wire(EntryInfo(modified_time=when))["modifiedTime"] == text


@pytest.mark.parametrize("bad", ["2026-12-04 03:27:02", "2026-13-04T03:27:02Z", "yesterday", 1796354822])
def test_bad_timestamps(bad: Any) -> None:
    with pytest.raises(ValidationError):
        EntryInfo.model_validate({"modifiedTime": bad})


def test_naive_datetime_refused() -> None:
    with pytest.raises(ValidationError, match="timezone-aware"):
        EntryInfo(modified_time=datetime(2026, 1, 1))


def test_timestamp_from_ns() -> None:
    assert timestamp_from_ns(1_796_354_822_773_869_123) == datetime(2026, 12, 4, 3, 27, 2, 773869, tzinfo=UTC)


def test_unknown_fields_ignored_and_null_is_default() -> None:
    req = StartRequest.model_validate_json('{"process": {"cmd": "ls", "future": [1]}, "tag": null, "nope": {}}')
    assert req.process.cmd == "ls" and req.tag is None
    assert EndEvent.model_validate_json('{"exitCode": null, "status": null}') == EndEvent()
    assert ProcessConfig.model_validate_json('{"args": null, "envs": null}') == ProcessConfig()


def test_request_defaults_read_like_proto3() -> None:
    req = SendInputRequest.model_validate_json("{}")
    assert req.process.pid is None and req.process.tag is None and req.input.stdin is None
    assert StartRequest.model_validate_json("{}").process.cmd == ""
    assert StartRequest.model_validate_json("{}").pty is None  # presence matters for the PTY
    assert ListDirRequest.model_validate_json("{}").depth == 0


def test_oneofs() -> None:
    with pytest.raises(ValidationError, match="at most one of start, end"):
        ProcessEvent.model_validate({"start": {"pid": 1}, "end": {}})
    with pytest.raises(ValidationError, match="at most one of pid, tag"):
        ProcessSelector(pid=1, tag="x")
    assert ProcessEvent(keepalive=KeepAlive()).which("event") == "keepalive"
    assert ProcessEvent().which("event") is None
    assert ProcessSelector.model_validate({"tag": "web"}).which("selector") == "tag"
    assert wire(ProcessSelector(pid=0)) == {"pid": 0}  # zero is set, not unset
    assert wire(ProcessEvent(keepalive=KeepAlive())) == {"keepalive": {}}


def test_unset_optionals_omitted() -> None:
    assert wire(ProcessInfo(pid=3)) == {"pid": 3}
    assert wire(StartResponse()) == {}
    assert "symlinkTarget" not in wire(EntryInfo()) and "modifiedTime" not in wire(EntryInfo())
    assert wire(FilesystemEvent(name="a", type=EventType.EVENT_TYPE_CREATE)) == {
        "name": "a",
        "type": "EVENT_TYPE_CREATE",
    }


def test_strict_bools() -> None:
    assert WatchDirRequest.model_validate({"recursive": True}).recursive is True
    with pytest.raises(ValidationError):
        WatchDirRequest.model_validate({"recursive": "yes"})


# -- against the SDK's own encoder -----------------------------------------------------------------------------------


@pytest.fixture
def pb() -> Any:
    pytest.importorskip("e2b")
    from e2b.envd.filesystem import filesystem_pb
    from e2b.envd.process import process_pb
    from protobuf import Oneof
    from protobuf.wkt import Timestamp

    class PB:
        process = process_pb
        fs = filesystem_pb

    PB.Oneof = Oneof  # type: ignore[attr-defined]
    PB.Timestamp = Timestamp  # type: ignore[attr-defined]
    return PB


def test_sdk_requests_parse(pb: Any) -> None:
    p, fs, Oneof = pb.process, pb.fs, pb.Oneof
    start = StartRequest.model_validate_json(
        p.StartRequest(
            process=p.ProcessConfig(cmd="/bin/bash", args=["-l", "-c", "ls"], envs={"A": "1"}, cwd="/home"),
            pty=p.PTY(size=p.PTY.Size(cols=80, rows=24)),
            tag="t1",
            stdin=True,
        ).to_json()
    )
    assert start.process == ProcessConfig(cmd="/bin/bash", args=["-l", "-c", "ls"], envs={"A": "1"}, cwd="/home")
    assert start.pty == PTY(size=PTYSize(cols=80, rows=24)) and start.tag == "t1" and start.stdin is True
    bare = StartRequest.model_validate_json(p.StartRequest(process=p.ProcessConfig(cmd="ls")).to_json())
    assert (bare.pty, bare.tag, bare.stdin, bare.process.cwd) == (None, None, None, None)

    kill = SendSignalRequest.model_validate_json(
        p.SendSignalRequest(process=p.ProcessSelector(selector=Oneof("pid", 12)), signal=p.Signal.SIGKILL).to_json()
    )
    assert kill.process.pid == 12 and kill.process.tag is None and kill.signal is Signal.SIGNAL_SIGKILL
    term = SendSignalRequest.model_validate_json(
        p.SendSignalRequest(process=p.ProcessSelector(selector=Oneof("tag", "web")), signal=p.Signal.SIGTERM).to_json()
    )
    assert term.process.tag == "web" and term.signal is Signal.SIGNAL_SIGTERM

    data = bytes(range(256))
    sent = SendInputRequest.model_validate_json(
        p.SendInputRequest(
            process=p.ProcessSelector(selector=Oneof("pid", 1)), input=p.ProcessInput(input=Oneof("pty", data))
        ).to_json()
    )
    assert sent.input.pty == data and sent.input.stdin is None

    streamed = [
        StreamInputRequest.model_validate_json(m.to_json())
        for m in (
            p.StreamInputRequest(
                event=Oneof(
                    "start", p.StreamInputRequest.StartEvent(process=p.ProcessSelector(selector=Oneof("pid", 5)))
                )
            ),
            p.StreamInputRequest(
                event=Oneof("data", p.StreamInputRequest.DataEvent(input=p.ProcessInput(input=Oneof("stdin", b"\n"))))
            ),
            p.StreamInputRequest(event=Oneof("keepalive", p.StreamInputRequest.KeepAlive())),
        )
    ]
    assert [m.which("event") for m in streamed] == ["start", "data", "keepalive"]
    assert streamed[0].start is not None and streamed[0].start.process.pid == 5
    assert streamed[1].data is not None and streamed[1].data.input.stdin == b"\n"

    update = UpdateRequest.model_validate_json(
        p.UpdateRequest(
            process=p.ProcessSelector(selector=Oneof("pid", 0)), pty=p.PTY(size=p.PTY.Size(cols=120, rows=40))
        ).to_json()
    )
    assert update.process.which("selector") == "pid" and update.process.pid == 0
    assert update.pty is not None and (update.pty.size.cols, update.pty.size.rows) == (120, 40)

    assert ListDirRequest.model_validate_json(fs.ListDirRequest(path="/tmp", depth=3).to_json()) == ListDirRequest(
        path="/tmp", depth=3
    )
    watch = WatchDirRequest.model_validate_json(
        fs.WatchDirRequest(path="/w", recursive=True, include_entry=True, allow_network_mounts=True).to_json()
    )
    assert watch == WatchDirRequest(path="/w", recursive=True, include_entry=True, allow_network_mounts=True)
    create = CreateWatcherRequest.model_validate_json(fs.CreateWatcherRequest(path="/w", recursive=True).to_json())
    assert create == CreateWatcherRequest(path="/w", recursive=True)
    got = GetWatcherEventsRequest.model_validate_json(fs.GetWatcherEventsRequest(watcher_id="w-1").to_json())
    assert got.watcher_id == "w-1"
    move = MoveRequest.model_validate_json(fs.MoveRequest(source="/a", destination="/b").to_json())
    assert (move.source, move.destination) == ("/a", "/b")


def test_sdk_entry_info_parses(pb: Any) -> None:
    fs = pb.fs
    entry = EntryInfo.model_validate_json(
        fs.EntryInfo(
            name="f",
            type=fs.FileType.SYMLINK,
            size=BIG,
            modified_time=pb.Timestamp(seconds=1796354822, nanos=773869123),
            symlink_target="/t",
            is_symlink=True,
            mode=0o777,
        ).to_json()
    )
    assert (entry.type, entry.size, entry.modified_time) == (FileType.FILE_TYPE_SYMLINK, BIG, WHEN)
    assert (entry.symlink_target, entry.is_symlink, entry.mode) == ("/t", True, 0o777)


def test_our_process_events_decode_in_the_sdk(pb: Any) -> None:
    p, Oneof = pb.process, pb.Oneof

    def sdk_event(event: ProcessEvent) -> Any:
        return p.StartResponse.from_json(StartResponse(event=event).to_wire(), ignore_unknown_fields=True).event.event

    assert sdk_event(ProcessEvent(start=StartEvent(pid=77))) == Oneof("start", p.ProcessEvent.StartEvent(pid=77))
    for stream in ("stdout", "stderr", "pty"):
        data = sdk_event(ProcessEvent(data=DataEvent.model_validate({stream: b"\x00\xffa+/"}))).value
        assert data.output == Oneof(stream, b"\x00\xffa+/")
    end = sdk_event(ProcessEvent(end=EndEvent(exit_code=-1, exited=False, status="signal: killed", error="x"))).value
    assert (end.exit_code, end.exited, end.status, end.error) == (-1, False, "signal: killed", "x")
    assert sdk_event(ProcessEvent(end=EndEvent(exit_code=255, exited=True))).value.exit_code == 255
    assert sdk_event(ProcessEvent(keepalive=KeepAlive())).field == "keepalive"

    listed = p.ListResponse.from_json(
        ListResponse(
            processes=[
                ProcessInfo(pid=4, tag="t", config=ProcessConfig(cmd="sh", args=["-c", "x"], envs={"K": "v"}, cwd="/")),
                ProcessInfo(pid=5, config=ProcessConfig(cmd="top")),
            ]
        ).to_wire(),
        ignore_unknown_fields=True,
    )
    first, second = listed.processes
    assert (first.pid, first.tag, first.config.cmd, list(first.config.args)) == (4, "t", "sh", ["-c", "x"])
    assert (dict(first.config.envs), first.config.cwd) == ({"K": "v"}, "/")
    assert not second.has_field("tag") and not second.config.has_field("cwd")


def test_our_entries_decode_in_the_sdk(pb: Any) -> None:
    fs = pb.fs
    entry = EntryInfo(
        name="big.bin",
        type=FileType.FILE_TYPE_FILE,
        path="/data/big.bin",
        size=BIG,
        mode=0o100644,
        permissions="-rw-r--r--",
        owner="user",
        group="user",
        modified_time=WHEN,
        metadata={"k": "v"},
    )
    sdk = fs.StatResponse.from_json(StatResponse(entry=entry).to_wire(), ignore_unknown_fields=True).entry
    assert (sdk.name, sdk.type, sdk.path, sdk.size) == ("big.bin", fs.FileType.FILE, "/data/big.bin", BIG)
    assert (sdk.mode, sdk.permissions, sdk.owner, sdk.group) == (0o100644, "-rw-r--r--", "user", "user")
    assert sdk.modified_time.to_datetime() == WHEN
    assert dict(sdk.metadata) == {"k": "v"} and not sdk.has_field("symlink_target") and sdk.is_symlink is False

    link = EntryInfo(name="l", type=FileType.FILE_TYPE_DIRECTORY, symlink_target="/real", is_symlink=True)
    listed = fs.ListDirResponse.from_json(ListDirResponse(entries=[entry, link]).to_wire(), ignore_unknown_fields=True)
    assert [e.type for e in listed.entries] == [fs.FileType.FILE, fs.FileType.DIRECTORY]
    assert listed.entries[1].symlink_target == "/real" and listed.entries[1].is_symlink is True


def test_our_watch_events_decode_in_the_sdk(pb: Any) -> None:
    fs, Oneof = pb.fs, pb.Oneof

    def sdk(response: WatchDirResponse) -> Any:
        return fs.WatchDirResponse.from_json(response.to_wire(), ignore_unknown_fields=True).event

    assert sdk(WatchDirResponse(start=WatchDirStart())) == Oneof("start", fs.WatchDirResponse.StartEvent())
    assert sdk(WatchDirResponse(keepalive=KeepAlive())) == Oneof("keepalive", fs.WatchDirResponse.KeepAlive())
    event = sdk(
        WatchDirResponse(
            filesystem=FilesystemEvent(name="a.txt", type=EventType.EVENT_TYPE_WRITE, entry=EntryInfo(name="a.txt"))
        )
    ).value
    assert (event.name, event.type, event.entry.name) == ("a.txt", fs.EventType.WRITE, "a.txt")

    batch = fs.GetWatcherEventsResponse.from_json(
        GetWatcherEventsResponse(
            events=[FilesystemEvent(name=n, type=t) for n, t in (("x", EventType.EVENT_TYPE_REMOVE), ("y", 5))]
        ).to_wire(),
        ignore_unknown_fields=True,
    )
    assert [(e.name, e.type) for e in batch.events] == [("x", fs.EventType.REMOVE), ("y", fs.EventType.CHMOD)]
    assert not batch.events[0].has_field("entry")
    created = fs.CreateWatcherResponse.from_json(CreateWatcherResponse(watcher_id="w-9").to_wire())
    assert created.watcher_id == "w-9"
