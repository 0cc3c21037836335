"""``python -m dsec.cluster``: the ``dsec cluster`` commands, whether or not the main CLI includes them."""

from ..cli.cluster import cluster_app

cluster_app(prog_name="dsec cluster")
