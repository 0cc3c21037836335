"""``make demo``: a burst of agent-style rollouts on the embedded default."""
