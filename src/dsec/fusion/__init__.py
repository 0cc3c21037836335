"""The SandboxFusion-compatible API (``dsec serve --sandbox-fusion-listen``): docs/sandbox-fusion.md."""
