"""The node daemon's HTTP API: handlers translate between wire models and the core, nothing more."""
