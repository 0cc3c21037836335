"""Which guest kernel VMs boot: the pinned series, newest by version (not by a sort of the text)."""

from __future__ import annotations

import pytest

from dsec.errors import BackendError
from dsec.kinds.microvm.guest import KERNEL_SERIES, choose_kernel, kernel_pin

SEEN = [  # apt-cache search on Debian 12, plus the versions a text sort orders wrongly
    "6.1.0-9",
    "6.1.0-47",
    "6.1.0-57",
    "6.12.99+deb12",
    "6.12.107+deb12",
    "6.12.118+deb12",
]


def test_the_newest_of_the_series_by_version() -> None:
    assert choose_kernel(SEEN, "6.12") == "6.12.118+deb12"
    assert choose_kernel(SEEN, "6.1") == "6.1.0-57"  # not 6.1.0-9, and never a 6.12


def test_an_exact_version_pins_that_one() -> None:
    assert choose_kernel(SEEN, "6.12.107+deb12") == "6.12.107+deb12"


def test_a_pin_nothing_matches_is_a_clear_error() -> None:
    with pytest.raises(BackendError, match=r"no guest kernel 6\.13 .*available: 6\.1\.0-9, .*6\.12\.118\+deb12"):
        choose_kernel(SEEN, "6.13")


def test_the_pin_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DSEC_GUEST_KERNEL", raising=False)
    assert kernel_pin() == KERNEL_SERIES == "6.12"
    monkeypatch.setenv("DSEC_GUEST_KERNEL", "6.1")
    assert kernel_pin() == "6.1"
