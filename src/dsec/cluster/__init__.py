"""Scale-out: a node daemon per Ray node and a gateway that places sandboxes and routes their calls.

- ``placement``: pure placement over the nodes' reported capacity.
- ``nodes``: the node daemons behind a gateway, their health and last status.
- ``gateway``: the ASGI gateway exposing the node daemon's HTTP API (``DSEC_URL`` points at it).
- ``ray_nodes``: Ray actors that run and supervise one node daemon per Ray node (needs ``dsec[cluster]``).
- ``runner``: the gateway and the nodes run together (``dsec cluster up``).

Ray is imported only by ``ray_nodes`` and what starts it, so the gateway runs without it.
"""
