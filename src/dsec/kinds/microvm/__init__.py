"""The ``microvm`` and ``vm`` kinds: sandboxes that are QEMU virtual machines driven by a guest agent."""
