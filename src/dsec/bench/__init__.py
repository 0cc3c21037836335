"""Benchmarks: JSON out, peers measured side by side in the same run."""
