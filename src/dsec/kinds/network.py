"""Network policy for kinds whose sandboxes get an interface on the host: a veth for containers, a tap
for VMs. The node's ``NetworkHost`` (one per daemon, in the backend context) owns the ruleset and the
resolver; a kind only gives its sandbox the interface and configures the sandbox's side of it.

What a sandbox's record keeps (persisted, so a restarted daemon re-adopts it): ``net_index`` (its
address pair) and ``net_gen`` (the policy generation that marks its accepted connections).
"""

from __future__ import annotations

from abc import abstractmethod

from ..errors import InvalidRequest
from ..isolation.network import addresses
from ..isolation.network.host import Attached, NetworkHost
from ..protocol.network import NetworkSpec
from ..protocol.sandbox import NetworkStatus
from ..store.records import SandboxRecord
from .base import Backend
from .state import KindState


class PolicyNetwork(Backend):
    """``set_network`` and ``network_status`` for every kind that can enforce a policy."""

    # the VM kinds keep their tap when a policy is lifted (QEMU holds it); a container's veth goes
    keep_interface: bool = False

    @property
    def net(self) -> NetworkHost:
        if self.ctx.net is None:
            raise InvalidRequest("network policies are not set up on this node")
        return self.ctx.net

    def check_network(self, policy: NetworkSpec) -> None:
        if policy is None:
            return
        if self.ctx.net is None or self.ctx.net.error is not None:
            why = self.ctx.net.error if self.ctx.net is not None else "not set up"
            raise InvalidRequest(f"network policies are unavailable on this node: {why}")

    @abstractmethod
    async def _attach_network(self, rec: SandboxRecord, policy: NetworkSpec) -> Attached:
        """Give the running sandbox its interface, address and ``policy`` (first policy after None)."""

    async def _configure_sandbox_side(self, rec: SandboxRecord, attached: Attached) -> None:
        """Point the sandbox's resolver at the platform's (and, for VMs, configure the guest's NIC)."""

    async def _join_network(self, rec: SandboxRecord, policy: NetworkSpec) -> None:
        attached = await self._attach_network(rec, policy)
        KindState(rec).joined(attached.index, attached.gen)
        await self._configure_sandbox_side(rec, attached)

    async def _leave_network(self, rec: SandboxRecord) -> None:
        state = KindState(rec)
        index = state.net_index
        state.joined(None, None)
        if index is not None and self.ctx.net is not None:
            await self.ctx.net.detach(rec.id, index, keep_interface=self.keep_interface)

    async def _adopt_network(self, rec: SandboxRecord) -> None:
        """After a daemon restart: the sandbox's rules as they were (once per daemon run)."""
        state = KindState(rec)
        index, gen = state.net_index, state.net_gen
        if index is not None and gen is not None and self.ctx.net is not None:
            await self.ctx.net.adopt(rec.id, index, rec.network, gen)

    async def set_network(self, rec: SandboxRecord, policy: NetworkSpec) -> None:
        self.check_network(policy)
        index = KindState(rec).net_index
        if policy is None:
            await self._leave_network(rec)
        elif index is None:
            await self._join_network(rec, policy)
        else:
            KindState(rec).changed(await self.net.change(rec.id, index, policy))
        rec.network = policy

    async def network_status(self, rec: SandboxRecord) -> NetworkStatus:
        index = KindState(rec).net_index
        if index is None:
            return NetworkStatus(policy=rec.network)
        denied, denied_dns, allowed = await self.net.status(rec.id, index)
        return NetworkStatus(
            policy=rec.network,
            address=addresses.Pair(index).sandbox,
            resolver=await self.net.resolver_address(),
            denied_packets=denied,
            denied_dns=denied_dns,
            allowed=allowed,
        )
