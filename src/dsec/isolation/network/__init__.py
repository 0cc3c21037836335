"""Per-sandbox network policy, enforced on the host side: a veth pair per sandbox (no bridge, so sandboxes
never share L2), one nftables table per daemon, and a platform DNS resolver that feeds allowlisted names'
addresses into each sandbox's allow set.

policy.py parses what a client asks for; addresses.py leases point-to-point addresses host-wide; nft.py
writes the ruleset; resolver.py answers DNS; host.py puts them together for one daemon.
"""
