"""Test doubles shared by every suite: an in-memory sandbox kind and fake built images (backend), fake node
daemons behind a real gateway (cluster)."""
