"""Caller levels: what the key a request presented lets it open (seed 004's `machine:<name>`).

The API key middleware (`app.ApiKeyMiddleware`) records the level of the key that admitted a
request in the scope's state: the server's own `api_key` and the console's login have
`MAX_LEVEL`, each `[[api_keys]]` entry its own level. Every route that opens a machine passes
that level on (`Registry.open` refuses a machine whose `level` is higher: `machine_denied`,
403), so a key is checked on every open, not once per session. A server without keys serves
its loopback callers at `MAX_LEVEL`.
"""

from __future__ import annotations

from starlette.requests import HTTPConnection

from agentbox.config import MAX_LEVEL

#: The scope state key the middleware sets.
CALLER_LEVEL = "caller_level"


def caller_level(connection: HTTPConnection) -> int:
    """The level the key middleware recorded for this request; `MAX_LEVEL` on a server without keys."""
    state = connection.scope.get("state") or {}
    return int(state.get(CALLER_LEVEL, MAX_LEVEL))
