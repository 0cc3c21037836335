"""The function kind's node settings (``dsec serve --function-*``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ...errors import InvalidRequest
from .pool import PoolConfig


@dataclass(frozen=True)
class Prewarm:
    image: str
    count: int  # idle workers kept ready (the pool's min_idle)


@dataclass(frozen=True)
class FunctionOptions:
    config: PoolConfig = field(default_factory=PoolConfig)
    prewarm: tuple[Prewarm, ...] = ()

    @classmethod
    def of(
        cls,
        pools: list[str],
        max_workers: int | None = None,
        idle_ttl: float | None = None,
        tenant_max: int | None = None,
        max_uses: int | None = None,
    ) -> FunctionOptions:
        config = PoolConfig()
        if max_workers is not None:
            config = dataclasses.replace(config, max_workers=max_workers)
        if idle_ttl is not None:
            config = dataclasses.replace(config, idle_ttl=idle_ttl)
        if tenant_max is not None:
            config = dataclasses.replace(config, tenant_max=tenant_max)
        if max_uses is not None:
            config = dataclasses.replace(config, max_uses=max_uses)
        prewarm = tuple(parse_pool(p) for p in pools)
        for p in prewarm:
            if p.count > config.max_workers:
                raise InvalidRequest(f"--function-pool {p.image}={p.count}: over --function-max {config.max_workers}")
        return cls(config=config, prewarm=prewarm)


def parse_pool(spec: str) -> Prewarm:
    """``IMAGE=N``: keep N workers of IMAGE (default limits, no network) warm from daemon start."""
    image, sep, count = spec.rpartition("=")
    if not sep or not image or not count.isdigit() or not 1 <= int(count) <= 4096:
        raise InvalidRequest(f"--function-pool {spec!r} must look like IMAGE=N (N from 1 to 4096)")
    return Prewarm(image=image, count=int(count))
