"""The ``container`` kind: an OCI runtime (crun, runc as fallback) over overlayfs."""
