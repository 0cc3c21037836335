"""Host-side isolation primitives: mounts, cgroups, seccomp, safe path resolution."""
