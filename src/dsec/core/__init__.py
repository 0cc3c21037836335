"""The sandbox lifecycle core: state machine, TTL reaper, dispatch to kinds."""
