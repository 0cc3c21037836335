"""The messages of envd's ``process`` and ``filesystem`` services, in their proto3-JSON form.

The e2b SDKs speak Connect with the JSON codec only, so these pydantic models stand in for generated protobuf
classes. They follow the proto3 JSON mapping (https://protobuf.dev/programming-guides/json/):

- field names are lowerCamelCase on output; lowerCamelCase and the proto's snake_case are both accepted;
- ``bytes`` are base64 (standard or URL-safe, padded or not, on input; standard and padded on output);
- ``int64`` is a JSON string on output, a string or a number on input; 32-bit ints are numbers (or strings);
- enums are output by name and accepted by name or number. An enum value this file does not know (a number or a
  name from a newer proto) becomes the ``*_UNSPECIFIED`` member, so the server code only ever sees known members
  and rejects "unspecified" where it needs a value, as it would for a client that sent none;
- ``google.protobuf.Timestamp`` is an aware UTC ``datetime``, an RFC 3339 string on the wire (sub-microsecond
  digits are dropped: Python's datetime has no nanoseconds);
- unknown fields are ignored, as the SDK's own codec does; ``null`` means the field's default, as in proto3 JSON;
- a ``oneof`` is a set of optional fields of which at most one may be set (see ``WireModel.oneofs``); ``None``
  means unset and unset fields are not output.

Message-typed fields of *request* messages default to an empty message rather than ``None``: proto3 reads an
unset sub-message as its default, and the routes can then write ``req.process.pid`` without a None check. Where
presence carries meaning (``optional PTY pty``) the field stays ``None`` when unset. Message-typed fields of
responses and events default to ``None`` so that unset ones are omitted.

Names follow the proto; nested messages are flattened (``ProcessEvent.StartEvent`` is ``StartEvent``,
``StreamInputRequest.StartEvent`` is ``StreamInputStart``, ``WatchDirResponse.StartEvent`` is ``WatchDirStart``).
The three empty ``KeepAlive`` messages of the protos share one class: they are all ``{}`` on the wire.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from enum import IntEnum
from typing import Annotated, Any, ClassVar, Self, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, Strict, model_validator
from pydantic.alias_generators import to_camel

# -- scalar encodings ------------------------------------------------------------------------------------------------

_INT_TEXT = re.compile(r"-?[0-9]+")
# proto3 JSON allows exponent notation for integers as long as the value is integral ("1e3")
_NUMBER_TEXT = re.compile(r"-?[0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")


def _int_parser(lo: int, hi: int) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        # bool is an int subclass, but `true` is no integer in proto3 JSON
        if isinstance(value, bool):
            raise ValueError("expected an integer, got a boolean")
        if isinstance(value, int):
            number = value
        elif isinstance(value, float):
            if not value.is_integer():
                raise ValueError(f"expected an integer, got {value!r}")
            number = int(value)
        elif isinstance(value, str):
            if _INT_TEXT.fullmatch(value):
                number = int(value)
            elif _NUMBER_TEXT.fullmatch(value):
                exact = Decimal(value)
                # compared before int(): int(Decimal("1e999999999")) would build a gigantic integer
                if not (lo <= exact <= hi) or exact != exact.to_integral_value():
                    raise ValueError(f"{value!r} is not an integer in [{lo}, {hi}]")
                number = int(exact)
            else:
                raise ValueError(f"expected an integer, got {value!r}")
        else:
            raise ValueError("expected an integer")
        if not lo <= number <= hi:
            raise ValueError(f"{number} is out of range [{lo}, {hi}]")
        return number

    return parse


def _json_as(encode: Callable[[Any], str]) -> PlainSerializer:
    """How a field is written in JSON (Python-mode dumps keep the Python value)."""
    return PlainSerializer(encode, return_type=str, when_used="json")


# JavaScript numbers lose integers past 2**53, hence the strings for 64-bit ints
Int32 = Annotated[int, BeforeValidator(_int_parser(-(2**31), 2**31 - 1))]
UInt32 = Annotated[int, BeforeValidator(_int_parser(0, 2**32 - 1))]
Int64 = Annotated[int, BeforeValidator(_int_parser(-(2**63), 2**63 - 1)), _json_as(str)]
# proto3 JSON bools are `true`/`false` only; pydantic's lax mode would take "yes" or 1
Bool = Annotated[bool, Strict()]

_URL_SAFE_TO_STANDARD = str.maketrans("-_", "+/")


def _parse_bytes(value: Any) -> bytes:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if not isinstance(value, str):
        raise ValueError("expected base64 text")
    text = value.translate(_URL_SAFE_TO_STANDARD).rstrip("=")
    if len(text) % 4 == 1:
        raise ValueError("invalid base64: bad length")
    try:
        return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except binascii.Error:
        raise ValueError("invalid base64") from None


def _bytes_text(value: bytes) -> str:
    return base64.b64encode(value).decode("ascii")


# A str given for a bytes field is taken as its wire form (base64), whether it comes from JSON or from Python.
Bytes = Annotated[bytes, BeforeValidator(_parse_bytes), _json_as(_bytes_text)]

_RFC3339 = re.compile(
    r"([0-9]{4})-([0-9]{2})-([0-9]{2})[Tt ]([0-9]{2}):([0-9]{2}):([0-9]{2})"
    r"(?:\.([0-9]{1,9}))?([Zz]|[+-][0-9]{2}:[0-9]{2})"
)


def _parse_timestamp(value: Any) -> datetime:
    if isinstance(value, datetime):
        # a naive datetime is most likely local time by mistake (datetime.fromtimestamp without tz)
        if value.tzinfo is None:
            raise ValueError("timestamp must be timezone-aware")
        return value.astimezone(UTC)
    if not isinstance(value, str):
        raise ValueError("expected an RFC 3339 timestamp string")
    match = _RFC3339.fullmatch(value)
    if match is None:
        raise ValueError(f"expected an RFC 3339 timestamp, got {value[:40]!r}")
    year, month, day, hour, minute, second = (int(match[i]) for i in range(1, 7))
    micros = int((match[7] or "").ljust(6, "0")[:6])
    offset = match[8]
    if offset in ("Z", "z"):
        tz = UTC
    else:
        sign = -1 if offset[0] == "-" else 1
        tz = timezone(sign * timedelta(hours=int(offset[1:3]), minutes=int(offset[4:6])))
    try:
        return datetime(year, month, day, hour, minute, second, micros, tzinfo=tz).astimezone(UTC)
    except (ValueError, OverflowError) as e:
        raise ValueError(f"invalid timestamp {value[:40]!r}: {e}") from None


def _timestamp_text(value: datetime) -> str:
    t = value.astimezone(UTC)
    # f-string rather than strftime: %Y does not zero-pad years below 1000 on glibc
    text = f"{t.year:04d}-{t.month:02d}-{t.day:02d}T{t.hour:02d}:{t.minute:02d}:{t.second:02d}"
    # 0, 3 or 6 fractional digits, as protojson writes them (it also has 9, which microseconds never need)
    us = t.microsecond
    return text + ("" if not us else f".{us // 1000:03d}" if us % 1000 == 0 else f".{us:06d}") + "Z"


Timestamp = Annotated[datetime, BeforeValidator(_parse_timestamp), _json_as(_timestamp_text)]


def timestamp_from_ns(ns: int) -> datetime:
    """An ``os.stat`` ``st_*_ns`` value as a Timestamp, without the float rounding of ``fromtimestamp``."""
    return datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=ns // 1000)


E = TypeVar("E", bound=IntEnum)


def _enum_parser(cls: type[E]) -> Callable[[Any], E]:
    unspecified = cls(0)

    def parse(value: Any) -> E:
        if isinstance(value, cls):
            return value
        if isinstance(value, bool):
            raise ValueError(f"expected a {cls.__name__} name or number")
        if isinstance(value, str):
            member = cls.__members__.get(value)
            if member is not None:
                return member
            if not _INT_TEXT.fullmatch(value):
                return unspecified
            value = int(value)
        if isinstance(value, int):
            try:
                return cls(value)
            except ValueError:
                return unspecified
        raise ValueError(f"expected a {cls.__name__} name or number")

    return parse


def _enum_name(value: IntEnum) -> str:
    return value.name


# -- the base --------------------------------------------------------------------------------------------------------


class WireModel(BaseModel):
    """A proto3-JSON message. ``to_wire()`` is its JSON; ``oneofs`` names its oneof groups and their members."""

    # validate_by_name + validate_by_alias is pydantic 2.11's spelling of populate_by_name=True
    model_config = ConfigDict(extra="ignore", validate_by_name=True, validate_by_alias=True, alias_generator=to_camel)

    oneofs: ClassVar[dict[str, tuple[str, ...]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    @model_validator(mode="after")
    def _at_most_one_per_oneof(self) -> Self:
        for group, members in self.oneofs.items():
            present = [to_camel(m) for m in members if getattr(self, m) is not None]
            if len(present) > 1:
                raise ValueError(f"oneof {group!r}: at most one of {', '.join(present)} may be set")
        return self

    def which(self, group: str) -> str | None:
        """The (snake_case) name of the member of oneof ``group`` that is set, or None."""
        for member in self.oneofs[group]:
            if getattr(self, member) is not None:
                return member
        return None

    def to_wire(self) -> bytes:
        """The compact proto3-JSON encoding."""
        return self.model_dump_json(by_alias=True, exclude_none=True).encode()


class KeepAlive(WireModel):
    """The empty keep-alive message of ProcessEvent, StreamInputRequest and WatchDirResponse."""


# -- package process -------------------------------------------------------------------------------------------------


class Signal(IntEnum):
    SIGNAL_UNSPECIFIED = 0
    SIGNAL_SIGTERM = 15
    SIGNAL_SIGKILL = 9


SignalValue = Annotated[Signal, BeforeValidator(_enum_parser(Signal)), _json_as(_enum_name)]


class PTYSize(WireModel):
    cols: UInt32 = 0
    rows: UInt32 = 0


class PTY(WireModel):
    size: PTYSize = Field(default_factory=PTYSize)


class ProcessConfig(WireModel):
    cmd: str = ""
    args: list[str] = Field(default_factory=list)
    envs: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None


class ProcessSelector(WireModel):
    oneofs = {"selector": ("pid", "tag")}
    pid: UInt32 | None = None
    tag: str | None = None


class ProcessInput(WireModel):
    oneofs = {"input": ("stdin", "pty")}
    stdin: Bytes | None = None
    pty: Bytes | None = None


class ListRequest(WireModel): ...


class ProcessInfo(WireModel):
    config: ProcessConfig | None = None
    pid: UInt32 = 0
    tag: str | None = None


class ListResponse(WireModel):
    processes: list[ProcessInfo] = Field(default_factory=list)


class StartRequest(WireModel):
    process: ProcessConfig = Field(default_factory=ProcessConfig)
    pty: PTY | None = None
    tag: str | None = None
    stdin: Bool | None = None


class UpdateRequest(WireModel):
    process: ProcessSelector = Field(default_factory=ProcessSelector)
    pty: PTY | None = None


class UpdateResponse(WireModel): ...


class StartEvent(WireModel):
    pid: UInt32 = 0


class DataEvent(WireModel):
    oneofs = {"output": ("stdout", "stderr", "pty")}
    stdout: Bytes | None = None
    stderr: Bytes | None = None
    pty: Bytes | None = None


class EndEvent(WireModel):
    exit_code: Int32 = 0  # sint32 on the proto's binary wire; JSON does not care
    exited: Bool = False
    status: str = ""
    error: str | None = None


class ProcessEvent(WireModel):
    oneofs = {"event": ("start", "data", "end", "keepalive")}
    start: StartEvent | None = None
    data: DataEvent | None = None
    end: EndEvent | None = None
    keepalive: KeepAlive | None = None


class StartResponse(WireModel):
    event: ProcessEvent | None = None


class ConnectResponse(WireModel):
    event: ProcessEvent | None = None


class ConnectRequest(WireModel):
    process: ProcessSelector = Field(default_factory=ProcessSelector)


class SendInputRequest(WireModel):
    process: ProcessSelector = Field(default_factory=ProcessSelector)
    input: ProcessInput = Field(default_factory=ProcessInput)


class SendInputResponse(WireModel): ...


class StreamInputStart(WireModel):
    process: ProcessSelector = Field(default_factory=ProcessSelector)


class StreamInputData(WireModel):
    input: ProcessInput = Field(default_factory=ProcessInput)


class StreamInputRequest(WireModel):
    oneofs = {"event": ("start", "data", "keepalive")}
    start: StreamInputStart | None = None
    data: StreamInputData | None = None
    keepalive: KeepAlive | None = None


class StreamInputResponse(WireModel): ...


class SendSignalRequest(WireModel):
    process: ProcessSelector = Field(default_factory=ProcessSelector)
    signal: SignalValue = Signal.SIGNAL_UNSPECIFIED


class SendSignalResponse(WireModel): ...


class CloseStdinRequest(WireModel):
    process: ProcessSelector = Field(default_factory=ProcessSelector)


class CloseStdinResponse(WireModel): ...


# -- package filesystem ----------------------------------------------------------------------------------------------


class FileType(IntEnum):
    FILE_TYPE_UNSPECIFIED = 0
    FILE_TYPE_FILE = 1
    FILE_TYPE_DIRECTORY = 2
    FILE_TYPE_SYMLINK = 3


class EventType(IntEnum):
    EVENT_TYPE_UNSPECIFIED = 0
    EVENT_TYPE_CREATE = 1
    EVENT_TYPE_WRITE = 2
    EVENT_TYPE_REMOVE = 3
    EVENT_TYPE_RENAME = 4
    EVENT_TYPE_CHMOD = 5


FileTypeValue = Annotated[FileType, BeforeValidator(_enum_parser(FileType)), _json_as(_enum_name)]
EventTypeValue = Annotated[EventType, BeforeValidator(_enum_parser(EventType)), _json_as(_enum_name)]


class EntryInfo(WireModel):
    name: str = ""
    type: FileTypeValue = FileType.FILE_TYPE_UNSPECIFIED
    path: str = ""
    size: Int64 = 0
    mode: UInt32 = 0
    permissions: str = ""
    owner: str = ""
    group: str = ""
    modified_time: Timestamp | None = None
    symlink_target: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    is_symlink: Bool = False


class MoveRequest(WireModel):
    source: str = ""
    destination: str = ""


class MoveResponse(WireModel):
    entry: EntryInfo | None = None


class MakeDirRequest(WireModel):
    path: str = ""


class MakeDirResponse(WireModel):
    entry: EntryInfo | None = None


class RemoveRequest(WireModel):
    path: str = ""


class RemoveResponse(WireModel): ...


class StatRequest(WireModel):
    path: str = ""


class StatResponse(WireModel):
    entry: EntryInfo | None = None


class ListDirRequest(WireModel):
    path: str = ""
    depth: UInt32 = 0


class ListDirResponse(WireModel):
    entries: list[EntryInfo] = Field(default_factory=list)


class WatchDirRequest(WireModel):
    path: str = ""
    recursive: Bool = False
    include_entry: Bool = False
    allow_network_mounts: Bool = False


class FilesystemEvent(WireModel):
    name: str = ""
    type: EventTypeValue = EventType.EVENT_TYPE_UNSPECIFIED
    entry: EntryInfo | None = None


class WatchDirStart(WireModel): ...


class WatchDirResponse(WireModel):
    oneofs = {"event": ("start", "filesystem", "keepalive")}
    start: WatchDirStart | None = None
    filesystem: FilesystemEvent | None = None
    keepalive: KeepAlive | None = None


class CreateWatcherRequest(WireModel):
    path: str = ""
    recursive: Bool = False
    include_entry: Bool = False
    allow_network_mounts: Bool = False


class CreateWatcherResponse(WireModel):
    watcher_id: str = ""


class GetWatcherEventsRequest(WireModel):
    watcher_id: str = ""


class GetWatcherEventsResponse(WireModel):
    events: list[FilesystemEvent] = Field(default_factory=list)


class RemoveWatcherRequest(WireModel):
    watcher_id: str = ""


class RemoveWatcherResponse(WireModel): ...
