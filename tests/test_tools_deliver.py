"""deliver_file: files copied out of a real sandbox into a real file store (SQLite + blobs)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from conftest import traversable

from agentbox.ids import FILE, SANDBOX, is_id, new_id
from agentbox.machines.base import ExecRequest
from agentbox.machines.sandbox import SandboxConfig, SandboxHost, SandboxMachine
from agentbox.store.db import Database
from agentbox.store.files import FileStore
from agentbox.tools import deliver
from agentbox.tools.base import Action, Operation, TodoStore, ToolConfig, ToolResult
from agentbox.tools.base import FileStore as FileStoreProtocol
from agentbox.tools.deliver import DELIVER_FILE, MAX_DELIVERIES_PER_TURN, MAX_DELIVERY_BYTES, DeliverParams
from tests.scoped import Scoped

pytestmark = pytest.mark.asyncio(loop_scope="module")


class MemoryTodos:
    async def get(self, session_id: str) -> list[dict[str, Any]]:
        return []

    async def put(self, session_id: str, items: list[dict[str, Any]]) -> None:
        pass


@dataclass
class Ctx(Scoped):
    machine: Any
    files: FileStoreProtocol | None
    session_id: str = "ses_deliver"
    turn_id: str | None = "trn_deliver"
    config: ToolConfig = field(default_factory=ToolConfig)
    reads: dict[str, str] = field(default_factory=dict)
    todos: TodoStore = field(default_factory=MemoryTodos)
    deliveries: int = 0
    tool_use_id: str | None = "toolu_deliver"
    services: Any = None  # no machine services: tools make what they need
    refusal: str | None = None
    asked: list[tuple[Action, str, dict[str, Any]]] = field(default_factory=list)

    async def commit(self, operations: list[Operation], tool: str) -> ToolResult:
        raise AssertionError("deliver_file never plans workspace operations")

    async def authorize(self, action: Action, tool: str, detail: dict[str, Any]) -> str | None:
        self.asked.append((action, tool, detail))
        return self.refusal


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def machine(
    sandbox_host: SandboxHost, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[SandboxMachine]:
    d = traversable(tmp_path_factory.mktemp("deliver-tool"), tmp_path_factory)
    m = SandboxMachine(
        "sandbox", new_id(SANDBOX), sandbox_host, SandboxConfig(network=False), d / "workspace", d / "run"
    )
    await m.start()
    yield m
    await m.stop()


@pytest_asyncio.fixture(loop_scope="module")
async def store(tmp_path: Path) -> AsyncIterator[FileStore]:
    async with Database.in_home(tmp_path / "home") as db:
        yield FileStore(db, tmp_path / "home")


async def run(ctx: Ctx, *paths: str, path: str | None = None) -> ToolResult:
    return await DELIVER_FILE.run(ctx, DeliverParams(paths=list(paths) or None, path=path))


async def test_a_file_made_in_the_sandbox_is_delivered(machine: SandboxMachine, store: FileStore) -> None:
    ctx = Ctx(machine, store)
    made = await machine.exec(
        ExecRequest(command="mkdir -p out && printf 'region,total\\nnorth,42\\n' > out/summary.csv")
    )
    assert made.exit_code == 0
    result = await run(ctx, "out/summary.csv")
    assert not result.is_error and ctx.deliveries == 1
    [record] = result.data["files"]
    assert is_id(record["id"], FILE) and record["filename"] == "summary.csv" and record["bytes"] == 22
    assert (
        result.as_text()
        == f"Delivered 1 file:\n- summary.csv (22 bytes, id {record['id']}) from out/summary.csv"
    )
    stored = await store.get(record["id"])
    assert (stored["session_id"], stored["source"], stored["turn_id"]) == (
        "ses_deliver",
        "delivery",
        "trn_deliver",
    )
    assert (await store.open(record["id"])).read_bytes() == b"region,total\nnorth,42\n"
    assert ctx.asked == []  # inside the workspace: bookkeeping, nothing to ask
    # `path` alone works too, and the absolute spelling is the same file.
    again = await run(ctx, path="/workspace/out/summary.csv")
    assert again.data["files"][0]["filename"] == "summary.csv" and ctx.deliveries == 2


async def test_partial_failure_lists_only_what_was_delivered(
    machine: SandboxMachine, store: FileStore
) -> None:
    (machine.workspace / "a.txt").write_text("A")
    (machine.workspace / "b.txt").write_text("BB")
    (machine.workspace / "folder").mkdir(exist_ok=True)
    ctx = Ctx(machine, store)
    result = await run(ctx, "a.txt", "missing.txt", "folder", "b.txt", "a.txt")
    assert not result.is_error and ctx.deliveries == 2
    assert [f["filename"] for f in result.data["files"]] == ["a.txt", "b.txt"]
    assert result.data["failed"] == [
        {"path": "missing.txt", "reason": "no such file"},
        {
            "path": "folder",
            "reason": "it is a folder or not a regular file (archive a folder first, e.g. with tar or zip)",
        },
    ]
    text = result.as_text()
    assert text.startswith("Delivered 2 files:\n") and "Not delivered:\n- missing.txt: no such file" in text
    assert [r["filename"] for r in await store.list("ses_deliver")] == ["b.txt", "a.txt"]


async def test_nothing_delivered_is_an_error(machine: SandboxMachine, store: FileStore) -> None:
    ctx = Ctx(machine, store)
    result = await run(ctx, "nope-1", "nope-2")
    assert result.is_error and result.data["files"] == [] and len(result.data["failed"]) == 2
    assert result.as_text().startswith("No file was delivered.") and ctx.deliveries == 0
    empty = await run(ctx)
    assert empty.is_error and "Nothing to deliver" in empty.as_text()
    no_store = await run(Ctx(machine, None), "a.txt")
    assert no_store.is_error and "not available" in no_store.as_text()


async def test_the_eleventh_delivery_of_a_turn_is_refused(machine: SandboxMachine, store: FileStore) -> None:
    for i in range(MAX_DELIVERIES_PER_TURN + 1):
        (machine.workspace / f"f{i}.txt").write_text(str(i))
    ctx = Ctx(machine, store)
    first = await run(ctx, *(f"f{i}.txt" for i in range(MAX_DELIVERIES_PER_TURN - 1)))
    assert len(first.data["files"]) == MAX_DELIVERIES_PER_TURN - 1
    tenth = await run(ctx, f"f{MAX_DELIVERIES_PER_TURN - 1}.txt")
    assert not tenth.is_error and ctx.deliveries == MAX_DELIVERIES_PER_TURN
    eleventh = await run(ctx, f"f{MAX_DELIVERIES_PER_TURN}.txt")
    assert eleventh.is_error and ctx.deliveries == MAX_DELIVERIES_PER_TURN
    assert f"the limit of {MAX_DELIVERIES_PER_TURN} deliveries per turn is reached" in eleventh.as_text()
    assert len(await store.list("ses_deliver")) == MAX_DELIVERIES_PER_TURN
    # A new turn starts counting again (the runner resets ctx.deliveries); one call past the limit
    # delivers up to it and reports the rest.
    turn = Ctx(machine, store, turn_id="trn_next")
    many = await run(turn, *(f"f{i}.txt" for i in range(MAX_DELIVERIES_PER_TURN + 1)))
    assert len(many.data["files"]) == MAX_DELIVERIES_PER_TURN and not many.is_error
    assert many.data["failed"] == [
        {
            "path": f"f{MAX_DELIVERIES_PER_TURN}.txt",
            "reason": "the limit of 10 deliveries per turn is reached",
        }
    ]


async def test_the_100_mib_boundary(machine: SandboxMachine, store: FileStore) -> None:
    exact = machine.workspace / "exact.bin"
    over = machine.workspace / "over.bin"
    for path, size in ((exact, MAX_DELIVERY_BYTES), (over, MAX_DELIVERY_BYTES + 1)):
        with path.open("wb") as f:
            f.truncate(size)  # sparse: nothing written here
    ctx = Ctx(machine, store)
    result = await run(ctx, "over.bin", "exact.bin")
    assert [f["bytes"] for f in result.data["files"]] == [MAX_DELIVERY_BYTES] == [100 * 1024 * 1024]
    assert result.data["failed"] == [
        {
            "path": "over.bin",
            "reason": f"it is {MAX_DELIVERY_BYTES + 1} bytes, more than the 100 MiB a file may be",
        }
    ]
    assert ctx.deliveries == 1


async def test_files_outside_the_workspace_are_an_external_read(
    machine: SandboxMachine, store: FileStore
) -> None:
    (machine.workspace / "hostname-link").unlink(missing_ok=True)
    os.symlink("/etc/hostname", machine.workspace / "hostname-link")
    ctx = Ctx(machine, store, refusal="reading outside the workspace needs approval")
    result = await run(ctx, "/etc/hostname", "hostname-link")
    assert result.is_error and ctx.deliveries == 0
    assert [f["reason"] for f in result.data["failed"]] == [
        "reading outside the workspace needs approval"
    ] * 2
    assert ctx.asked == [(Action.READ_EXTERNAL, "deliver_file", {"path": "/etc/hostname"})] * 2
    allowed = Ctx(machine, store)
    delivered = await run(allowed, "/etc/hostname")
    assert delivered.data["files"][0]["filename"] == "hostname"
    assert (await store.open(delivered.data["files"][0]["id"])).read_bytes() == await machine.read(
        "/etc/hostname"
    )


async def test_tool_metadata() -> None:
    assert DELIVER_FILE.action == Action.META and not DELIVER_FILE.read_only
    assert all(p.get("description") for p in DELIVER_FILE.schema()["properties"].values())
    assert set(deliver.TOOLS) == {"deliver_file"}
