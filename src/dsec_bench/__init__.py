"""Benchmarks: JSON out, peers measured side by side in the same run. A package beside dsec: it imports dsec,
and dsec imports it only to register ``dsec bench`` (dsec.cli.main)."""
