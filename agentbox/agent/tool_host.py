"""A turn's tools as the loop needs them: `SessionTools` over the session's machine, opened
before each call, with the running call's id known to approvals and subagents."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from agentbox.agent.models import ToolCall, ToolSpec
from agentbox.agent.providers.arguments import invalid_arguments
from agentbox.agent.subagents import Subagents, calling
from agentbox.tools.base import Action, ToolResult
from agentbox.tools.runner import SessionTools
from agentbox.tools.services import MachineServices
from agentbox.tools.tiers import decide


@dataclass
class SessionToolHost:
    """`SessionTools` as the loop needs it; the session's machine is (re)opened before each call,
    with its services (None: a session without a machine)."""

    tools: SessionTools
    open_services: Callable[[], Awaitable[MachineServices | None]]
    subagents: Subagents | None = None

    def specs(self) -> list[ToolSpec]:
        return [ToolSpec(t.name, t.description, t.schema()) for t in self.tools.offered()]

    def permission(self, name: str) -> str:
        tool = self.tools.toolset.get(name)
        if tool is None:
            return "unknown"
        return str(decide(self.tools.tier, tool.action, plan=self.tools.plan))

    def read_only(self, name: str) -> bool:
        tool = self.tools.toolset.get(name)
        return tool is not None and tool.read_only

    def touches_machine(self, name: str) -> bool:
        """Whether a call of `name` needs the machine opened (a sandbox started or resumed):
        not for tools that work elsewhere (`todo_write`, the web tools, `Tool.machine` false);
        `task` does, for its child's tools. An unknown name opens nothing: it is an error."""
        tool = self.tools.toolset.get(name)
        return tool is not None and (tool.machine or tool.action == Action.TASK)

    def parallel(self, call: ToolCall) -> bool:
        tool = self.tools.toolset.get(call.name)
        agent = call.input.get("agent")
        return (
            tool is not None and tool.action == Action.TASK and self.subagents is not None
            and isinstance(agent, str) and self.subagents.read_only(agent)
        )  # fmt: skip

    async def call(self, call: ToolCall, preapproved: str | None = None) -> ToolResult:
        problem = invalid_arguments(call)  # a provider sent arguments that are not JSON
        if problem is not None:
            return ToolResult.error(problem)
        if self.touches_machine(call.name):
            services = await self.open_services()
            self.tools.machine = services.machine if services is not None else None
            self.tools.services = services
        with calling(call.id):
            return await self.tools.call(call.name, call.input, preapproved=preapproved, tool_use_id=call.id)
