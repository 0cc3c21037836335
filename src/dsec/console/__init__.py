"""The web console at /ui, served by the node daemon and by the cluster gateway (docs/console.md): the
page's files, and the session that lets a browser use the ordinary API with a cookie instead of a token."""

from .middleware import Console, Verify

__all__ = ["Console", "Verify"]
