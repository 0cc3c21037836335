from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError

import dsec
from dsec import errors
from dsec.errors import (
    ERRORS_BY_CODE,
    BackendError,
    DaemonUnreachable,
    DigestMismatch,
    DsecError,
    FileNotFoundInSandbox,
    ImageNotFound,
    InvalidRequest,
    InvalidState,
    LimitExceeded,
    NotFound,
    RegistryAuthFailed,
    RegistryError,
    RegistryUnreachable,
    SandboxGone,
    SandboxNotFound,
    SandboxTimeout,
    Unauthorized,
    error_from_wire,
    validation_message,
)
from dsec.protocol.sandbox import CreateSandbox, ExecRequest


def _all_subclasses(cls: type) -> set[type]:
    found = set()
    for sub in cls.__subclasses__():
        found.add(sub)
        found |= _all_subclasses(sub)
    return found


def test_every_error_class_has_a_unique_code() -> None:
    classes = [DsecError, *sorted(_all_subclasses(DsecError), key=lambda c: c.__name__)]
    classes = [c for c in classes if c.__module__ == errors.__name__]
    codes = [c.code for c in classes]
    assert len(codes) == len(set(codes)), codes
    assert set(ERRORS_BY_CODE.values()) == set(classes)


def test_errors_by_code_keys_match_the_classes() -> None:
    for code, cls in ERRORS_BY_CODE.items():
        assert cls.code == code
        assert 400 <= cls.http_status < 600


@pytest.mark.parametrize(
    ("cls", "builtin"),
    [
        (SandboxTimeout, TimeoutError),
        (InvalidRequest, ValueError),
        (SandboxNotFound, LookupError),
        (ImageNotFound, LookupError),
        (NotFound, LookupError),
        (DaemonUnreachable, ConnectionError),
        (FileNotFoundInSandbox, FileNotFoundError),
        (Unauthorized, PermissionError),
        (LimitExceeded, OSError),
        (BackendError, RuntimeError),
        (SandboxGone, InvalidState),
        (SandboxNotFound, NotFound),
        (RegistryError, RuntimeError),
        (RegistryUnreachable, ConnectionError),
        (RegistryUnreachable, RegistryError),
        (RegistryAuthFailed, PermissionError),
        (DigestMismatch, ValueError),
        (DigestMismatch, RegistryError),
    ],
)
def test_errors_are_the_builtin_that_fits(cls: type[DsecError], builtin: type[BaseException]) -> None:
    assert issubclass(cls, DsecError)
    assert issubclass(cls, builtin)
    err = cls("boom")
    with pytest.raises(builtin):
        raise err


def test_statuses() -> None:
    assert InvalidRequest.http_status == 400
    assert Unauthorized.http_status == 401
    assert SandboxNotFound.http_status == 404
    assert InvalidState.http_status == 409
    assert SandboxGone.http_status == 410
    assert LimitExceeded.http_status == 413
    assert BackendError.http_status == 500
    assert SandboxTimeout.http_status == 504


def test_str_is_the_message_even_for_oserror_subclasses() -> None:
    for cls in ERRORS_BY_CODE.values():
        err = cls("the message", detail={"k": 1})
        assert str(err) == "the message"
        assert err.message == "the message"
        assert err.detail == {"k": 1}


def test_detail_defaults_to_empty_dict() -> None:
    assert DsecError("x").detail == {}


@pytest.mark.parametrize("code", sorted(ERRORS_BY_CODE))
def test_error_from_wire_round_trip(code: str) -> None:
    original = ERRORS_BY_CODE[code]("something went wrong", detail={"state": "stopped"})
    rebuilt = error_from_wire(original.code, original.message, original.detail)
    assert type(rebuilt) is type(original)
    assert rebuilt.code == code
    assert rebuilt.message == "something went wrong"
    assert rebuilt.detail == {"state": "stopped"}


def test_error_from_wire_unknown_code_is_the_root_class() -> None:
    err = error_from_wire("no_such_code", "strange", None)
    assert type(err) is DsecError
    assert err.message == "strange"
    assert err.detail == {}


def test_errors_are_exported_from_the_package() -> None:
    for cls in ERRORS_BY_CODE.values():
        assert getattr(dsec, cls.__name__) is cls


# ---- validation_message -------------------------------------------------------------------------------


def _validation_error(model: type[BaseModel], data: object) -> ValidationError:
    try:
        model.model_validate(data)
    except ValidationError as e:
        return e
    raise AssertionError("expected a ValidationError")


def test_validation_message_names_the_field() -> None:
    msg = validation_message(_validation_error(ExecRequest, {"cmd": "true", "timeout": -1}))
    assert msg.startswith("timeout: ")
    assert "greater than 0" in msg
    assert "\n" not in msg


def test_validation_message_nested_field_is_dotted() -> None:
    msg = validation_message(_validation_error(CreateSandbox, {"limits": {"memory": "1Mi"}}))
    assert msg.startswith("limits.memory: ")
    assert "at least 8Mi" in msg


def test_validation_message_joins_several_and_keeps_five() -> None:
    bad = {"cmd": "", "timeout": -1, "cwd": "rel", "output_limit": 1, "stdin": 5, "x": 1, "y": 2}
    msg = validation_message(_validation_error(ExecRequest, bad))
    assert msg.count("; ") == 4


def test_validation_message_drops_body_query_path_prefixes() -> None:
    class Fake(Exception):
        def errors(self) -> list[dict[str, object]]:
            return [
                {"loc": ("body", "timeout"), "msg": "too small"},
                {"loc": ("query", "mode"), "msg": "too big"},
                {"loc": ("body",), "msg": "not JSON"},
                {"loc": ()},
            ]

    assert validation_message(Fake()) == "timeout: too small; mode: too big; request: not JSON; request: invalid"


def test_validation_message_keeps_a_field_named_path() -> None:
    class Fake(Exception):
        def errors(self) -> list[dict[str, object]]:
            return [{"loc": ("query", "path"), "msg": "Field required"}]

    assert validation_message(Fake()) == "path: Field required"


def test_validation_message_of_no_errors() -> None:
    class Empty(Exception):
        def errors(self) -> list[dict[str, object]]:
            return []

    assert validation_message(Empty()) == "invalid request"


def test_validation_message_of_a_plain_exception() -> None:
    assert validation_message(ValueError("plain words")) == "plain words"
