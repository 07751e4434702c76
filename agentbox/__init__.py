"""agentbox: a self-hosted execution environment for AI agents."""

__version__ = "0.1.0"
