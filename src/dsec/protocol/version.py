"""The version of dsec, as the daemon reports it and the SDK and CLI show it."""

__version__ = "0.1.0"
