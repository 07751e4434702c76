"""agentbox: a self-hosted execution environment for AI agents."""
