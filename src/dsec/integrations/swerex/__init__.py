"""SWE-ReX on dsec: ``DsecDeployment`` (an ``AbstractDeployment``) runs its commands in a dsec sandbox
through ``DsecRuntime`` (an ``AbstractRuntime``), with persistent bash sessions (see ``session.py``).

    from dsec.integrations.swerex import DsecDeploymentConfig

    deployment = DsecDeploymentConfig(image="dsec/debian:12").get_deployment()
    await deployment.start()
    await deployment.runtime.create_session(CreateBashSessionRequest())
    ...
    await deployment.stop()

Needs the ``swerex`` extra: ``pip install 'dsec[swerex]'`` (SWE-ReX 1.4.0).
"""

from __future__ import annotations

try:
    import swerex  # noqa: F401
except ModuleNotFoundError as e:  # pragma: no cover - the message is the point
    raise ModuleNotFoundError("dsec.integrations.swerex needs SWE-ReX: pip install 'dsec[swerex]'") from e

from .deployment import DsecDeployment, DsecDeploymentConfig
from .runtime import DsecRuntime

__all__ = ["DsecDeployment", "DsecDeploymentConfig", "DsecRuntime"]
