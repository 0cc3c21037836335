"""Adapters that let agent harnesses run their commands in dsec sandboxes.

Each integration is a module of its own with an optional extra (``pip install 'dsec[minisweagent]'``,
``'dsec[swerex]'``, ``'dsec[harbor]'``, ``'dsec[openenv]'``) and is imported only by the harness that
selects it: nothing else in dsec imports this package, and the modules in it use only dsec's public SDK
(``import dsec``), as any user's code would.
"""
