"""The exec tool in a real bubblewrap sandbox (one per module, network off)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from conftest import SANDBOX_DEADLINE, host_pid_of, traversable

from agentbox.agent.prompt import assemble
from agentbox.ids import SANDBOX, new_id
from agentbox.machines.base import TRASH_DIR, ExecRequest, Process
from agentbox.machines.sandbox import SandboxConfig, SandboxHost, SandboxMachine
from agentbox.tools.base import Action, FileStore, Operation, TextBlock, TodoStore, ToolConfig, ToolResult
from agentbox.tools.services import MachineServices
from agentbox.tools.shell import (
    DEFAULT_TIMEOUT_SECONDS,
    EXEC,
    FALLBACK_SHELL,
    MAX_CAPTURE_BYTES,
    MAX_TIMEOUT_SECONDS,
    MIN_TIMEOUT_SECONDS,
    OUTPUT_DIR,
    TAIL_MAX_BYTES,
    TAIL_MAX_LINES,
    TIMEOUT_EXIT_CODE,
    ExecParams,
    secret_names,
    shell_argv,
    shell_command,
)
from agentbox.workspace.commands import KEPT_HEAD_BYTES
from tests.scoped import Scoped

pytestmark = pytest.mark.asyncio(loop_scope="module")

#: Variables the sandbox's machine config injects into every command (env providers).
INJECTED = {
    "OPENAI_API_KEY": "sk-injected",
    "GITHUB_TOKEN": "ghp-injected",
    "DB_PASSWORD": "hunter2",
    "ALLOWED_SECRET": "kept-because-allowed",
    "GIT_AUTHOR_NAME": "Ada",
    "PLAIN_SETTING": "plain",
}


#: A config that lets every injected variable through: nothing to hide, so the shell is spawned
#: directly (`shell_argv`), not through `/bin/sh -c 'exec env -u ...'`.
NOTHING_HIDDEN = ToolConfig(exec_env_allow=list(INJECTED))


class MemoryTodos:
    def __init__(self) -> None:
        self.items: dict[str, list[dict[str, Any]]] = {}

    async def get(self, session_id: str) -> list[dict[str, Any]]:
        return self.items.get(session_id, [])

    async def put(self, session_id: str, items: list[dict[str, Any]]) -> None:
        self.items[session_id] = items


@dataclass
class Ctx(Scoped):
    """A real ToolContext for exec: authorize answers `refusal` and records what was asked."""

    machine: Any
    session_id: str = "ses_exec"
    turn_id: str | None = "trn_exec"
    config: ToolConfig = field(default_factory=lambda: ToolConfig(exec_env_allow=["ALLOWED_SECRET"]))
    reads: dict[str, str] = field(default_factory=dict)
    todos: TodoStore = field(default_factory=MemoryTodos)
    files: FileStore | None = None
    deliveries: int = 0
    services: Any = None  # no machine services: tools make what they need
    refusal: str | None = None
    asked: list[tuple[Action, str, dict[str, Any]]] = field(default_factory=list)

    async def commit(self, operations: list[Operation], tool: str) -> ToolResult:
        raise AssertionError("exec never plans workspace operations")

    async def authorize(self, action: Action, tool: str, detail: dict[str, Any]) -> str | None:
        self.asked.append((action, tool, detail))
        return self.refusal


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def machine(
    sandbox_host: SandboxHost, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[SandboxMachine]:
    d = traversable(tmp_path_factory.mktemp("exec-tool"), tmp_path_factory)
    config = SandboxConfig(network=False, env=INJECTED)
    m = SandboxMachine("sandbox", new_id(SANDBOX), sandbox_host, config, d / "workspace", d / "run")
    await m.start()
    yield m
    await m.stop()


async def run(machine: SandboxMachine, command: str, ctx: Ctx | None = None, **params: Any) -> ToolResult:
    return await EXEC.run(ctx or Ctx(machine), ExecParams(command=command, **params))


def text(result: ToolResult) -> str:
    assert all(isinstance(b, TextBlock) for b in result.content)
    return result.as_text()


def host_pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # gone, also between the open and the read
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def until(predicate: Any, what: str) -> None:
    end = time.monotonic() + SANDBOX_DEADLINE
    while not predicate():
        assert time.monotonic() < end, what
        await asyncio.sleep(0.02)


# -- exit codes, streams -----------------------------------------------------------------


async def test_success_shows_exit_code_and_stdout(machine: SandboxMachine) -> None:
    ctx = Ctx(machine)
    result = await run(machine, "echo hello; echo world", ctx)
    assert not result.is_error
    assert text(result) == "Exit code: 0\n<stdout>\nhello\nworld\n</stdout>"
    assert result.data["exit_code"] == 0 and not result.data["timed_out"]
    assert ctx.asked == [(Action.EXEC, "exec", {"command": "echo hello; echo world", "cwd": None})]


async def test_failure_keeps_stdout_and_stderr_apart(machine: SandboxMachine) -> None:
    result = await run(machine, "echo out; echo err >&2; exit 3")
    assert result.is_error and result.data["exit_code"] == 3
    assert text(result) == "Exit code: 3\n<stdout>\nout\n</stdout>\n<stderr>\nerr\n</stderr>"


async def test_no_output_and_death_by_signal(machine: SandboxMachine) -> None:
    quiet = await run(machine, "true")
    assert text(quiet) == "Exit code: 0\n(no output)" and not quiet.is_error
    killed = await run(machine, "kill -9 $$")
    assert killed.is_error and killed.data["exit_code"] == 137
    assert text(killed).startswith("Exit code: 137 (killed by signal 9, SIGKILL)")


async def test_cwd(machine: SandboxMachine) -> None:
    (machine.workspace / "sub").mkdir(exist_ok=True)
    (machine.workspace / "file.txt").write_text("x")
    assert "/workspace/sub" in text(await run(machine, "pwd", cwd="sub"))
    assert "/workspace\n" in text(await run(machine, "pwd"))
    missing = await run(machine, "pwd", cwd="/workspace/nope")
    assert missing.is_error and "does not exist" in text(missing)
    not_dir = await run(machine, "pwd", cwd="file.txt")
    assert not_dir.is_error and "not a directory" in text(not_dir)


async def test_empty_command_is_an_error(machine: SandboxMachine) -> None:
    result = await run(machine, "   ")
    assert result.is_error and "empty" in text(result)


# -- timeouts ----------------------------------------------------------------------------


@pytest.mark.parametrize("seconds", [MIN_TIMEOUT_SECONDS - 1, MAX_TIMEOUT_SECONDS + 1])
async def test_timeout_out_of_range_is_refused_before_asking(machine: SandboxMachine, seconds: int) -> None:
    ctx = Ctx(machine)
    result = await run(machine, "true", ctx, timeoutSeconds=seconds)
    assert result.is_error and f"between {MIN_TIMEOUT_SECONDS} and {MAX_TIMEOUT_SECONDS}" in text(result)
    assert ctx.asked == []


@pytest.mark.parametrize("seconds", [MIN_TIMEOUT_SECONDS, MAX_TIMEOUT_SECONDS])
async def test_timeout_range_ends_are_accepted(machine: SandboxMachine, seconds: int) -> None:
    assert not (await run(machine, "true", timeoutSeconds=seconds)).is_error


async def test_timeout_schema_and_default() -> None:
    schema = EXEC.schema()["properties"]["timeoutSeconds"]
    assert (schema["minimum"], schema["maximum"], schema["default"]) == (5, 1800, DEFAULT_TIMEOUT_SECONDS)
    assert (DEFAULT_TIMEOUT_SECONDS, MIN_TIMEOUT_SECONDS, MAX_TIMEOUT_SECONDS) == (120, 5, 1800)
    assert set(EXEC.schema()["required"]) == {"command"}


async def test_timeout_is_a_result_and_kills_every_descendant(machine: SandboxMachine) -> None:
    """timeoutSeconds=5 (the minimum) on a command that would take 6 s, leaving a grandchild behind."""
    pid_file = machine.workspace / "grandchild.pid"
    pid_file.unlink(missing_ok=True)
    command = (
        "sleep 1000 & echo $! $(readlink /proc/self/ns/pid) > /workspace/grandchild.pid; "
        "echo started; echo working >&2; sleep 6; echo never"
    )
    started = time.monotonic()
    task = asyncio.create_task(run(machine, command, timeoutSeconds=MIN_TIMEOUT_SECONDS))
    await until(lambda: pid_file.exists() and pid_file.read_text().endswith("\n"), "no grandchild pid")
    inside_pid, ns = pid_file.read_text().split()
    host_pid = host_pid_of(int(inside_pid), int(ns.removeprefix("pid:[").rstrip("]")))
    assert host_pid is not None and host_pid_alive(host_pid)
    result = await task
    elapsed = time.monotonic() - started
    assert MIN_TIMEOUT_SECONDS <= elapsed < 6, elapsed  # killed at the deadline, not after the sleep
    assert result.is_error and result.data["timed_out"] and result.data["exit_code"] == TIMEOUT_EXIT_CODE
    assert text(result).startswith(f"Command timed out after {MIN_TIMEOUT_SECONDS} seconds")
    assert f"exit code {TIMEOUT_EXIT_CODE}" in text(result)
    assert "<stdout>\nstarted\n</stdout>" in text(result) and "<stderr>\nworking\n</stderr>" in text(result)
    await until(lambda: not host_pid_alive(host_pid), "grandchild survived the timeout")


# -- cancellation ------------------------------------------------------------------------


@pytest.mark.parametrize("config", [ToolConfig(), NOTHING_HIDDEN], ids=["through-sh", "shell-spawned"])
async def test_a_cancelled_call_kills_the_command_group(machine: SandboxMachine, config: ToolConfig) -> None:
    pid_file = machine.workspace / "cancel.pid"
    pid_file.unlink(missing_ok=True)
    command = "sleep 1000 & echo $! $(readlink /proc/self/ns/pid) > /workspace/cancel.pid; wait"
    task = asyncio.create_task(run(machine, command, Ctx(machine, config=config)))
    await until(lambda: pid_file.exists() and pid_file.read_text().endswith("\n"), "no pid")
    inside_pid, ns = pid_file.read_text().split()
    host_pid = host_pid_of(int(inside_pid), int(ns.removeprefix("pid:[").rstrip("]")))
    assert host_pid is not None
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await until(lambda: not host_pid_alive(host_pid), "the command outlived its cancelled call")


async def test_a_command_stopped_from_outside_reads_as_cancelled(machine: SandboxMachine) -> None:
    services = MachineServices.of(machine)  # the machine's own engine, as /v2/commands kills through it
    manager = services.commands
    ctx = Ctx(machine, services=services)
    task = asyncio.create_task(run(machine, "echo before; sleep 1000", ctx))
    await until(lambda: any(c.stdout.total for c in manager.list()), "never started")
    manager.kill(manager.list()[0].id)
    result = await task
    assert result.is_error and result.data["cancelled"] and not result.data["timed_out"]
    assert text(result).startswith("Command was cancelled before it finished")
    assert "<stdout>\nbefore\n</stdout>" in text(result)
    await services.close()


# -- output limits -----------------------------------------------------------------------


async def saved_output(machine: SandboxMachine, result: ToolResult, stream: str = "stdout") -> bytes:
    path = result.data["output_files"][stream]
    assert path.startswith(OUTPUT_DIR + "/") and path in text(result)
    # The model reads it from inside the machine: prove a command there can.
    size = await run(machine, f"wc -c < {path}")
    data = await machine.read(path)
    assert f"<stdout>\n{len(data)}\n</stdout>" in text(size)
    return data


async def test_short_output_is_whole_and_unmarked(machine: SandboxMachine) -> None:
    lines = TAIL_MAX_LINES
    result = await run(machine, f"seq 1 {lines}")
    assert not result.data["stdout_truncated"] and "truncated" not in text(result)
    assert text(result).endswith(f"\n{lines}\n</stdout>") and "\n1\n" in text(result)
    assert result.data["output_files"] == {}


async def test_more_lines_than_shown_keeps_the_tail_and_saves_the_rest(machine: SandboxMachine) -> None:
    lines = TAIL_MAX_LINES + 1
    result = await run(machine, f"seq 1 {lines}")
    assert result.data["stdout_truncated"] and not result.is_error
    body = text(result)
    assert f"showing the last {TAIL_MAX_LINES} of {lines} lines" in body
    assert "<stdout>\n[stdout truncated" in body and "\n2\n3\n" in body and "\n1\n" not in body
    assert body.endswith(f"\n{lines}\n</stdout>")
    assert await saved_output(machine, result) == "".join(f"{i}\n" for i in range(1, lines + 1)).encode()


async def test_exactly_the_capture_limit_is_kept_whole(machine: SandboxMachine) -> None:
    # 16-byte lines; 1 MiB of them: captured whole, shown by its tail, saved in full.
    result = await run(machine, f"yes 0123456789abcde 2>/dev/null | head -c {MAX_CAPTURE_BYTES}")
    body = text(result)
    assert result.data["stdout_truncated"] and "capture limit" not in body
    assert len(body.encode()) < TAIL_MAX_BYTES + 1024
    assert body.endswith("0123456789abcde\n</stdout>")
    assert await saved_output(machine, result) == b"0123456789abcde\n" * (MAX_CAPTURE_BYTES // 16)


async def test_one_byte_past_the_capture_limit_drops_the_middle_and_says_so(machine: SandboxMachine) -> None:
    result = await run(machine, f"yes 0123456789abcde 2>/dev/null | head -c {MAX_CAPTURE_BYTES}; printf END")
    body = text(result)
    assert (
        f"the command wrote {MAX_CAPTURE_BYTES + 3} bytes to stdout, and the capture keeps "
        f"{MAX_CAPTURE_BYTES} bytes over both streams, so 3 bytes in the middle were dropped" in body
    )
    assert body.endswith("0123456789abcde\nEND\n</stdout>")
    saved = await saved_output(machine, result)
    marker = b"\n[... 3 bytes of output omitted ...]\n"
    assert saved.startswith(b"0123456789abcde\n" * (KEPT_HEAD_BYTES // 16) + marker)
    assert saved.endswith(b"0123456789abcde\nEND") and len(saved) == MAX_CAPTURE_BYTES + len(marker)


async def test_a_huge_single_line_is_cut_to_the_byte_budget(machine: SandboxMachine) -> None:
    result = await run(machine, f"head -c {TAIL_MAX_BYTES * 2} /dev/zero | tr '\\0' x; echo >&2 oops; exit 1")
    body = text(result)
    assert result.is_error and body.startswith("Exit code: 1")
    shown = body.split("<stdout>\n", 1)[1].split("\n", 1)[1].split("\n</stdout>")[0]
    assert set(shown) == {"x"} and len(shown) <= TAIL_MAX_BYTES
    assert "<stderr>\noops\n</stderr>" in body  # stderr keeps its share of the budget
    assert (await saved_output(machine, result)) == b"x" * (TAIL_MAX_BYTES * 2)


async def test_the_pipes_drain_far_past_the_cap(machine: SandboxMachine) -> None:
    result = await run(machine, f"head -c {8 * MAX_CAPTURE_BYTES} /dev/zero; echo done >&2")
    assert result.data["exit_code"] == 0 and "<stderr>\ndone\n</stderr>" in text(result)


# -- environment -------------------------------------------------------------------------


async def test_secret_variables_the_machine_injects_are_filtered(machine: SandboxMachine) -> None:
    result = await run(machine, "env")
    body = text(result)
    for name in ("OPENAI_API_KEY", "GITHUB_TOKEN", "DB_PASSWORD"):
        assert name not in body
    for secret in ("sk-injected", "ghp-injected", "hunter2"):
        assert secret not in body
    assert "ALLOWED_SECRET=kept-because-allowed" in body  # allowed by name in the config
    assert "GIT_AUTHOR_NAME=Ada" in body and "PLAIN_SETTING=plain" in body
    assert "PATH=" in body and "HOME=/root" in body
    # The command still sees its own arguments and quoting intact.
    quoted = await run(machine, "printf '%s|' \"$0\" 'a b' \"it's\"")
    assert text(quoted).endswith("|a b|it's|\n</stdout>")


async def test_without_allow_list_every_secret_goes(machine: SandboxMachine) -> None:
    ctx = Ctx(machine, config=ToolConfig())
    assert "ALLOWED_SECRET" not in text(await run(machine, "env", ctx))


async def test_secret_name_pattern() -> None:
    env = dict.fromkeys(
        ["AWS_SECRET_ACCESS_KEY", "api_key", "SSH_AUTH_SOCK", "NPM_TOKEN", "MYSQL_PWD_PASSWORD", "GPG_PASSPHRASE",
         "GOOGLE_APPLICATION_CREDENTIALS", "SESSION_COOKIE", "PRIVATE_URL", "GIT_AUTHOR_EMAIL", "PATH", "HOME", "LANG"],
        "v",
    )  # fmt: skip
    assert secret_names(env, ["NPM_TOKEN"]) == sorted(
        ["AWS_SECRET_ACCESS_KEY", "api_key", "SSH_AUTH_SOCK", "MYSQL_PWD_PASSWORD", "GPG_PASSPHRASE",
         "GOOGLE_APPLICATION_CREDENTIALS", "SESSION_COOKIE", "PRIVATE_URL"]
    )  # fmt: skip
    assert shell_command("echo hi", FALLBACK_SHELL) == "echo hi"
    assert shell_command("echo 'hi'", FALLBACK_SHELL, ["A_KEY"]) == (
        "exec env -u A_KEY /bin/sh -c 'echo '\"'\"'hi'\"'\"''"
    )
    assert shell_command("echo hi", "/usr/bin/bash") == "exec /usr/bin/bash -c 'echo hi'"
    assert shell_argv("echo hi", "/usr/bin/bash") == ("/usr/bin/bash", "-c", "echo hi")
    assert shell_argv("echo hi", "/usr/bin/bash", ["A_KEY"]) == ()  # the engine's sh runs env -u
    assert shell_argv("echo hi", FALLBACK_SHELL) == ()  # the engine's sh is the shell


# -- the shell ---------------------------------------------------------------------------


async def test_commands_run_with_bash_where_the_machine_has_it(machine: SandboxMachine) -> None:
    """Models write bash: `[[ ]]`, arrays and brace expansion work, and BASH_VERSION is set."""
    result = await run(machine, 'a=(x y); [[ ${#a[@]} -eq 2 ]] && echo {1..3} "$BASH_VERSION"')
    assert not result.is_error, text(result)
    assert "1 2 3 5." in text(result)  # Debian's bash 5


class Spawns:
    """The sandbox, noting what each spawn was asked to run."""

    def __init__(self, machine: SandboxMachine) -> None:
        self._machine = machine
        self.requests: list[ExecRequest] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._machine, name)

    async def spawn(self, request: ExecRequest) -> Process:
        self.requests.append(request)
        return await self._machine.spawn(request)


async def test_with_nothing_to_hide_the_shell_is_spawned_with_no_sh_in_front(machine: SandboxMachine) -> None:
    """One program fewer to start; the command, its quoting and its environment are the same."""
    spawns = Spawns(machine)
    command = """a=(x "y z"); printf '%s|' "${a[@]}" "it's" "$OPENAI_API_KEY" "$PWD" $0"""
    result = await EXEC.run(Ctx(spawns, config=NOTHING_HIDDEN), ExecParams(command=command, cwd="/tmp"))
    assert "<stdout>\nx|y z|it's|sk-injected|/tmp|/usr/bin/bash|\n</stdout>" in text(result)
    assert spawns.requests[-1].argv == ("/usr/bin/bash", "-c", command)
    hiding = await EXEC.run(Ctx(spawns), ExecParams(command="env"))
    assert "sk-injected" not in text(hiding)
    assert spawns.requests[-1].argv == () and spawns.requests[-1].command.startswith("exec env -u ")


class NoBash:
    """The sandbox as a machine without bash: `find_program` finds none."""

    def __init__(self, machine: SandboxMachine) -> None:
        self._machine = machine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._machine, name)

    async def find_program(self, name: str) -> str | None:
        return None if name == "bash" else await self._machine.find_program(name)


async def test_a_machine_without_bash_runs_sh_and_the_prompt_says_so(machine: SandboxMachine) -> None:
    plain = NoBash(machine)
    result = await EXEC.run(Ctx(plain), ExecParams(command='echo "[${BASH_VERSION:-none}]"'))
    assert "[none]" in text(result)
    assert "Shell: /bin/sh " in await assemble("", plain)  # type: ignore[arg-type]
    prompt = await assemble("", machine)
    assert "Shell: /usr/bin/bash (" in prompt
    assert TRASH_DIR not in prompt  # the listing beside it leaves the trash out


class Programs:
    """The sandbox, with `find_program` finding none of the names in `missing` (the host-side
    lookup sees the image, not what a command removed from the system layer)."""

    def __init__(self, machine: SandboxMachine) -> None:
        self._machine = machine
        self.missing: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._machine, name)

    async def find_program(self, name: str) -> str | None:
        return None if name in self.missing else await self._machine.find_program(name)


async def test_the_kept_shell_is_looked_up_again_when_it_goes_and_in_a_new_lifetime(
    sandbox_host: SandboxHost, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """bash removed from the system layer: one call fails to start it, the next runs /bin/sh;
    that is kept for the lifetime, and a restart (a fresh system layer) finds bash again."""
    d = traversable(tmp_path_factory.mktemp("exec-shell-cache"), tmp_path_factory)
    box = SandboxMachine(
        "sandbox", new_id(SANDBOX), sandbox_host, SandboxConfig(network=False), d / "w", d / "r"
    )
    await box.start()
    machine = Programs(box)
    services = MachineServices.of(machine)  # type: ignore[arg-type]
    try:
        ctx = Ctx(machine, services=services)
        assert await services.shell() == "/usr/bin/bash"
        assert "removed" in text(await run(box, "rm /usr/bin/bash && echo removed", ctx))
        machine.missing = {"bash"}
        failed = await run(box, "echo hi", ctx)
        assert failed.is_error and text(failed).startswith("Could not run the command")
        fallback = await run(box, 'echo "[${BASH_VERSION:-none}]"', ctx)
        assert "[none]" in text(fallback) and await services.shell() == FALLBACK_SHELL
        machine.missing = set()
        assert await services.shell() == FALLBACK_SHELL  # kept: the same lifetime
        await box.stop()
        await box.start()
        assert await services.shell() == "/usr/bin/bash"  # a new lifetime, a fresh system layer
        assert "5." in text(await run(box, 'echo "$BASH_VERSION"', ctx))
    finally:
        await services.close()
        await box.stop()


# -- permission --------------------------------------------------------------------------


async def test_a_refusal_runs_nothing(machine: SandboxMachine) -> None:
    marker = machine.workspace / "should-not-exist"
    ctx = Ctx(machine, refusal="denied by user")
    result = await run(machine, f"touch {marker.name}", ctx)
    assert result.is_error and text(result) == "denied by user"
    assert ctx.asked == [(Action.EXEC, "exec", {"command": f"touch {marker.name}", "cwd": None})]
    assert not marker.exists()


async def test_tool_metadata() -> None:
    assert (EXEC.name, EXEC.action, EXEC.read_only, EXEC.destructive) == ("exec", Action.EXEC, False, True)
    assert all(p.get("description") for p in EXEC.schema()["properties"].values())
