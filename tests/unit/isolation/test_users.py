from __future__ import annotations

import pytest

from dsec.errors import InvalidRequest
from dsec.isolation.users import ROOT, Account, resolve

PASSWD = """root:x:0:0:root:/root:/bin/sh
# a comment
agent:x:1000:1000:the runtime account:/home/agent:/bin/sh
svc:x:1500:1600::/srv:/bin/false
short:x
"""
GROUP = "root:x:0:\nstaff:x:50:agent\nagent:x:1000:\n"


@pytest.mark.parametrize(
    ("spec", "account"),
    [
        ("root", ROOT),
        ("0", ROOT),
        ("", ROOT),
        ("agent", Account(1000, 1000, "/home/agent")),
        ("1000", Account(1000, 1000, "/home/agent")),
        ("agent:staff", Account(1000, 50, "/home/agent")),
        ("svc:agent", Account(1500, 1000, "/srv")),
        ("2000", Account(2000, 2000, "/")),
        ("2000:50", Account(2000, 50, "/")),
        ("agent:77", Account(1000, 77, "/home/agent")),
    ],
)
def test_resolve(spec: str, account: Account) -> None:
    assert resolve(spec, PASSWD, GROUP) == account


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nobody", "not in the image's /etc/passwd"),
        ("agent:wheel", "not in the image's /etc/group"),
        ("70000", "outside the sandbox's ids"),
        ("agent;rm", "invalid user"),
        ("a:b:c", "invalid user"),
    ],
)
def test_resolve_refuses(spec: str, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        resolve(spec, PASSWD, GROUP)


def test_an_image_without_passwd_takes_numeric_ids() -> None:
    assert resolve("1234", "", "") == Account(1234, 1234, "/")
    assert not Account(1, 0, "/").is_root and ROOT.is_root
