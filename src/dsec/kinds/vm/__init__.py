"""The ``vm`` kind: a full QEMU machine booting the image's own init, driven by the microvm kind's agent."""
