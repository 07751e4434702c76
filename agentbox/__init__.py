"""agentbox: a self-hosted execution environment for AI agents.

The SDK's names (`agentbox.Client`, `agentbox.AsyncClient`, `agentbox.NotFound`, ...) are
those of `agentbox.client`, loaded on first use: `import agentbox` stays cheap for the CLI
and the server, which never need httpx's client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from agentbox.client import *  # noqa: F403


def __getattr__(name: str) -> Any:
    """A public name of `agentbox.client`, imported when first asked for."""
    import agentbox.client as client

    if name in client.__all__:
        return getattr(client, name)
    raise AttributeError(f"module 'agentbox' has no attribute {name!r}")


def __dir__() -> list[str]:
    import agentbox.client as client

    return sorted([*globals(), *client.__all__])
