"""The wire contract: every model and constraint the HTTP API and the SDK share.

A leaf: it imports only ``dsec.errors`` and ``dsec.units`` (and pydantic), so the SDK can depend on it
alone and the daemon never loads the client to know its own contract. Modules:

- ``types``: constrained strings, paths, commands, environments, labels;
- ``names``: image and tenant names;
- ``sandbox``: limits, sandbox specs and info, exec, files, images, tenants, audit, errors;
- ``network``: the network policy a client states; ``build``: image build specs; ``residue``: scrub
  rules and canaries;
- ``node``, ``run``, ``grade``, ``trajectory``: the node's, one-shot runs', grading's and trajectories' models;
- ``terminal``: the size of a command's pseudo-terminal;
- ``version``: ``__version__``.
"""
