"""What every test's hand-built `ToolContext` shares: the session's knowledge bases and file ids.

A test context holds `knowledge` (by default the whole workspace) and `file_ids` (None: the tools
record none); `scope` lays the knowledge bases over the machine's root, as `SessionTools` does.
"""

from __future__ import annotations

from typing import Any

from agentbox.tools.knowledge_bases import Scope, Selection


class Scoped:
    machine: Any
    knowledge: Selection = Selection()
    file_ids: Any = None

    @property
    def scope(self) -> Scope:
        return self.knowledge.scope(self.machine.root)
