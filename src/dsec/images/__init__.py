"""Images: named root filesystems made of read-only layers."""
