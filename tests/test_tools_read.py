"""`read` and `read_image` against a real bubblewrap sandbox, a local machine and an ssh machine.

The ssh machine logs in to the real sshd of tests/conftest.py (this host, as its unprivileged
user), so a test checks the remote side on disk as it does the others; its files go through
the `Machine` protocol only (`agentbox.workspace.fileops.RemoteOps`). Tests that are about
host files by nature (links resolved inside the descriptor view, escapes through them, a
kind's limits checked once) take `host_box` or `local` instead of `box`.

Fixtures are generated here: PDFs with fpdf2, DOCX files with python-docx, PNGs byte by
byte. Every limit is checked on both sides of its boundary. The test context below is a
real `ToolContext`: its `commit` applies operations with the governance module's
`apply_operations` (full-auto), its `authorize` answers as the test says and remembers what
was asked.
The write/edit and find tests import it from here.
"""

from __future__ import annotations

import base64
import io
import os
import posixpath
import pwd
import struct
import uuid
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docx
import pytest
import pytest_asyncio
from conftest import Dockerd, Server, Sshd, e2b_entry, host_fingerprint, traversable
from fpdf import FPDF

from agentbox.ids import SANDBOX, new_id
from agentbox.machines.base import ExecRequest
from agentbox.machines.docker import DockerHost, DockerMachine, DockerOptions
from agentbox.machines.e2b import E2BMachine, E2BOptions
from agentbox.machines.local import LocalMachine
from agentbox.machines.sandbox import SandboxConfig, SandboxHost, SandboxMachine
from agentbox.machines.ssh import SshMachine, SshOptions
from agentbox.tools.base import Action, ImageBlock, Operation, TextBlock, ToolConfig, ToolResult
from agentbox.tools.changes import Applied, apply_operations
from agentbox.tools.documents import MAX_DOCUMENT_BYTES, MAX_IMAGE_BYTES
from agentbox.tools.fingerprint import ABSENT
from agentbox.tools.read import (
    MAX_TEXT_BYTES,
    READ,
    READ_IMAGE,
    READ_WINDOW_CHARS,
    ReadImageParams,
    ReadParams,
)
from agentbox.workspace.fileops import file_ops
from tests.scoped import Scoped

pytestmark = pytest.mark.asyncio(loop_scope="module")

DENIED = "The user declined this read."


# --- a real tool context ------------------------------------------------------------------------


@dataclass
class Ctx(Scoped):
    """A ToolContext whose commit applies operations at once through the governance module's
    `apply_operations`, as the full-auto tier does (deletes go to the workspace's trash)."""

    machine: Any
    session_id: str = "ses_test"
    turn_id: str | None = "turn_test"
    config: ToolConfig = field(default_factory=ToolConfig)
    reads: dict[str, str] = field(default_factory=dict)
    todos: Any = None
    files: Any = None
    deliveries: int = 0
    services: Any = None  # no machine services: tools make what they need
    allow_external: bool = True
    asked: list[tuple[Action, str, dict[str, Any]]] = field(default_factory=list)
    committed: list[Operation] = field(default_factory=list)
    applied: list[Applied] = field(default_factory=list)

    async def authorize(self, action: Action, tool: str, detail: dict[str, Any]) -> str | None:
        self.asked.append((action, tool, detail))
        return None if self.allow_external else DENIED

    async def staged_folders(self) -> set[str]:
        return set()  # full-auto: nothing is staged

    async def commit(self, operations: list[Operation], tool: str) -> ToolResult:
        self.committed.extend(operations)
        results = await apply_operations(self.machine, operations)
        self.applied.extend(results)
        failed = [r.reason or r.status for r in results if not r.ok]
        if failed:
            return ToolResult.error("; ".join(failed))
        return ToolResult.text("; ".join(op.summary for op in operations), applied=len(operations))


@dataclass
class Box:
    """One test's folder on a machine: `p()` gives inside paths, `h()` host paths.

    `owner` is who the machine's files belong to when the machine cannot act as the test
    (the ssh login): what the test makes here is given to it, as a user's own files are."""

    machine: Any
    base: str
    host: Path
    owner: tuple[int, int] | None = None

    def p(self, rel: str = "") -> str:
        return posixpath.join(self.base, rel) if rel else self.base

    def h(self, rel: str = "") -> Path:
        return self.host / rel if rel else self.host

    def ctx(self, **kwargs: Any) -> Ctx:
        return Ctx(self.machine, **kwargs)

    def mkdir(self, rel: str) -> Path:
        """The folder `rel` and its missing parents, the machine's own."""
        path = self.h(rel)
        missing = [p for p in (path, *path.parents) if not p.exists()]
        path.mkdir(parents=True, exist_ok=True)
        for made in missing:
            self._own(made)
        return path

    def write(self, rel: str, data: bytes | str) -> Path:
        path = self.h(rel)
        self.mkdir(posixpath.dirname(rel))
        path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
        self._own(path)
        return path

    async def read_inside(self, inside: str, limit: int) -> bytes:
        """A file as the machine reads it (an inside path, which only the machine can map)."""
        return await file_ops(self.machine).read_bytes(inside, limit)

    def _own(self, path: Path) -> None:
        if self.owner is not None:
            os.lchown(path, *self.owner)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sandbox(
    sandbox_host: SandboxHost, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[SandboxMachine]:
    """One real sandbox (network off) for the module; each test works in its own folder of it."""
    d = traversable(tmp_path_factory.mktemp("tools-sandbox"), tmp_path_factory)
    sandbox_id = new_id(SANDBOX)
    machine = SandboxMachine(
        "sandbox", sandbox_id, sandbox_host, SandboxConfig(network=False), d / "workspace", d / "run"
    )
    await machine.start()
    yield machine
    await machine.stop()


def sandbox_box(sandbox: SandboxMachine, tmp_path: Path) -> Box:
    """A fresh folder of the module's sandbox workspace, for one test."""
    name = f"t-{uuid.uuid4().hex[:12]}"
    host = sandbox.workspace / name
    host.mkdir()
    os.lchown(host, sandbox.host.uid, sandbox.host.gid)
    return Box(sandbox, f"/workspace/{name}", host)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def docker(
    dockerd: Dockerd, docker_host: DockerHost, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[DockerMachine]:
    """One container (network off) for the module; each test works in its own folder of it."""
    d = traversable(tmp_path_factory.mktemp("tools-docker"), tmp_path_factory)
    options = DockerOptions.from_options({"docker_host": dockerd.host})
    machine = DockerMachine("docker", new_id(SANDBOX), docker_host, options, d / "workspace", d / "run")
    await machine.start()
    yield machine
    await machine.destroy()


def docker_box(docker: DockerMachine) -> Box:
    """A fresh folder of the module's container workspace, for one test."""
    name = f"t-{uuid.uuid4().hex[:12]}"
    host = docker.workspace / name
    host.mkdir()
    os.lchown(host, *docker.uid_gid)
    return Box(docker, f"/workspace/{name}", host, docker.uid_gid)


def local_box(tmp_path: Path) -> Box:
    machine = LocalMachine("local", tmp_path / "root")
    return Box(machine, machine.root, Path(machine.root))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ssh(sshd: Sshd, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SshMachine]:
    """One ssh machine (one connection) for the module, rooted at a folder of the ssh user's."""
    root = sshd.owned_dir(traversable(tmp_path_factory.mktemp("tools-ssh"), tmp_path_factory) / "root")
    machine = SshMachine("ssh", SshOptions.from_options(sshd.options(root=str(root))))
    await machine.start()
    yield machine
    await machine.close()


def ssh_box(ssh: SshMachine, sshd: Sshd) -> Box:
    """A fresh folder of the ssh machine's root (the remote host is this host: same paths)."""
    entry = pwd.getpwnam(sshd.user)
    base = posixpath.join(ssh.root, f"t-{uuid.uuid4().hex[:12]}")
    box = Box(ssh, base, Path(base), (entry.pw_uid, entry.pw_gid))
    box.mkdir("")
    return box


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def e2b(e2b_endpoint: Server) -> AsyncIterator[E2BMachine]:
    """One e2b machine (one E2B sandbox of agentbox's own endpoint) for the module."""
    options = E2BOptions.from_options(e2b_entry(e2b_endpoint))
    machine = E2BMachine("e2b", new_id(SANDBOX), options, session_id=new_id(SANDBOX))
    await machine.start()
    yield machine
    await machine.destroy()


def e2b_box(e2b: E2BMachine, endpoint: Server) -> Box:
    """A fresh folder of the e2b sandbox's workspace, which is a host folder of the endpoint's:
    what the test makes there is given to the sandbox's uid, as its own files are."""
    workspace = endpoint.home / "sessions" / str(e2b.sandbox_id) / "workspace"
    name = f"t-{uuid.uuid4().hex[:12]}"
    owner = workspace.stat()
    box = Box(e2b, f"/workspace/{name}", workspace / name, (owner.st_uid, owner.st_gid))
    box.mkdir("")
    return box


def make_box(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Box:
    """A box of `kind`; the module's sandbox or ssh machine is started only when one asks for it."""
    if kind == "sandbox":
        return sandbox_box(request.getfixturevalue("sandbox"), tmp_path)
    if kind == "ssh":
        return ssh_box(request.getfixturevalue("ssh"), request.getfixturevalue("sshd"))
    if kind == "docker":
        return docker_box(request.getfixturevalue("docker"))
    if kind == "e2b":
        return e2b_box(request.getfixturevalue("e2b"), request.getfixturevalue("e2b_endpoint"))
    return local_box(tmp_path)


@pytest.fixture(params=["sandbox", "docker", "local", "ssh", "e2b"])
def box(request: pytest.FixtureRequest, tmp_path: Path) -> Box:
    """A folder on each kind: host files by descriptor (sandbox, docker, local), ssh and e2b by
    protocol."""
    return make_box(request.param, request, tmp_path)


@pytest.fixture(params=["sandbox", "local"])
def host_box(request: pytest.FixtureRequest, tmp_path: Path) -> Box:
    """A folder on the kinds with host files, for what only the descriptor view can see."""
    return make_box(request.param, request, tmp_path)


@pytest.fixture
def local(tmp_path: Path) -> Box:
    return local_box(tmp_path)


async def read(ctx: Ctx, path: str, **params: Any) -> ToolResult:
    return await READ.run(ctx, ReadParams(path=path, **params))


def text_of(result: ToolResult) -> str:
    return result.as_text()


# --- fixtures: PDF, DOCX, images --------------------------------------------------------------------


def make_pdf(pages: list[str]) -> bytes:
    pdf = FPDF()
    pdf.set_font("helvetica", size=12)
    for text in pages:
        pdf.add_page()
        pdf.multi_cell(0, 8, text)
    return bytes(pdf.output())


def make_docx() -> bytes:
    d = docx.Document()
    d.add_heading("Handbook", 0)  # block 1 (title)
    d.add_heading("Intro", 1)  # block 2
    d.add_paragraph("Welcome to the team.")  # block 3
    d.add_paragraph("")  # empty: not a block
    d.add_heading("Tools", 2)  # block 4
    d.add_paragraph("We use Python.")  # block 5
    table = d.add_table(rows=2, cols=2)  # block 6
    table.cell(0, 0).text, table.cell(0, 1).text = "name", "role"
    table.cell(1, 0).text, table.cell(1, 1).text = "Ada", "engineer"
    d.add_heading("Holidays", 1)  # block 7
    d.add_paragraph("Twenty days a year.")  # block 8
    out = io.BytesIO()
    d.save(out)
    return out.getvalue()


def make_png(width: int = 2, height: int = 2) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data))
            + kind
            + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
        )

    rows = b"".join(b"\x00" + b"\xff\x00\x00" * width for _ in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# --- text by offset ---------------------------------------------------------------------------------


async def test_window_of_exactly_6000_characters_has_no_next_offset(box: Box) -> None:
    text = "é" * READ_WINDOW_CHARS  # characters, not bytes: 12000 bytes
    box.write("exact.txt", text)
    result = await read(box.ctx(), box.p("exact.txt"))
    assert not result.is_error
    assert result.data["nextOffset"] is None
    assert text_of(result) == text


async def test_window_of_6001_characters_gives_next_offset_and_continues(box: Box) -> None:
    text = "a" * READ_WINDOW_CHARS + "Z"
    box.write("over.txt", text)
    ctx = box.ctx()
    first = await read(ctx, box.p("over.txt"))
    assert first.data["nextOffset"] == READ_WINDOW_CHARS
    assert first.data["totalChars"] == READ_WINDOW_CHARS + 1
    body = text_of(first)
    assert body.startswith("a" * READ_WINDOW_CHARS + "\n\n[Showing characters 0-6000 of 6001.")
    assert "Use offset=6000 to continue." in body
    second = await read(ctx, box.p("over.txt"), offset=first.data["nextOffset"])
    assert text_of(second).startswith("Z")
    assert second.data["nextOffset"] is None


async def test_offset_past_the_end_fails_clearly(box: Box) -> None:
    box.write("short.txt", "abc")
    result = await read(box.ctx(), box.p("short.txt"), offset=3)
    assert result.is_error and "offset 3 is past the end" in text_of(result)


async def test_relative_paths_start_at_the_root_and_bom_is_dropped(box: Box) -> None:
    box.write("bom.txt", "\ufeffhello")
    rel = posixpath.relpath(box.p("bom.txt"), box.machine.root)
    result = await read(box.ctx(), rel)
    assert text_of(result) == "hello"


async def test_invalid_utf8_is_shown_with_a_note(box: Box) -> None:
    box.write("latin.txt", b"caf\xe9 au lait")
    result = await read(box.ctx(), box.p("latin.txt"))
    assert "not valid UTF-8" in text_of(result) and "caf\ufffd au lait" in text_of(result)


async def test_empty_file(box: Box) -> None:
    box.write("empty.txt", b"")
    result = await read(box.ctx(), box.p("empty.txt"))
    assert not result.is_error and "is empty" in text_of(result)


# --- text by lines -----------------------------------------------------------------------------------


async def test_line_range_is_numbered_like_cat_n(box: Box) -> None:
    box.write("lines.txt", "".join(f"line {n}\n" for n in range(1, 11)))
    result = await read(box.ctx(), box.p("lines.txt"), startLine=3, endLine=5)
    assert text_of(result).splitlines()[:3] == ["     3\tline 3", "     4\tline 4", "     5\tline 5"]
    assert "[Showing lines 3-5 of 10. Use startLine=6 to continue.]" in text_of(result)
    assert result.data["nextStartLine"] == 6


async def test_lines_fill_the_window_exactly_then_cut(box: Box) -> None:
    line = "x" * 99  # 100 characters with its newline: 60 lines fill the window exactly
    box.write("sixty.txt", (line + "\n") * 60)
    box.write("sixty-one.txt", (line + "\n") * 61)
    ctx = box.ctx()
    full = await read(ctx, box.p("sixty.txt"), startLine=1)
    assert full.data["endLine"] == 60 and full.data["nextStartLine"] is None
    cut = await read(ctx, box.p("sixty-one.txt"), startLine=1)
    assert cut.data["endLine"] == 60 and cut.data["nextStartLine"] == 61
    assert "Use startLine=61 to continue." in text_of(cut)


async def test_a_line_longer_than_the_window_points_to_offset(box: Box) -> None:
    box.write("long.txt", "short\n" + "y" * (READ_WINDOW_CHARS + 10) + "\nend\n")
    result = await read(box.ctx(), box.p("long.txt"), startLine=2)
    assert result.data["endLine"] == 2
    assert f"offset={6 + READ_WINDOW_CHARS}" in text_of(result)
    rest = await read(box.ctx(), box.p("long.txt"), offset=6 + READ_WINDOW_CHARS)
    assert text_of(rest).startswith("y" * 10 + "\nend")


async def test_line_range_errors(box: Box) -> None:
    box.write("three.txt", "a\nb\nc\n")
    ctx = box.ctx()
    past = await read(ctx, box.p("three.txt"), startLine=4)
    assert past.is_error and "it has 3 lines" in text_of(past)
    backwards = await read(ctx, box.p("three.txt"), startLine=3, endLine=2)
    assert backwards.is_error and "before startLine" in text_of(backwards)
    both = await read(ctx, box.p("three.txt"), startLine=1, offset=0)
    assert both.is_error and "not both" in text_of(both)
    page = await read(ctx, box.p("three.txt"), page=1)
    assert page.is_error and "PDF" in text_of(page)


# --- PDF ------------------------------------------------------------------------------------------------


@pytest.fixture
def pdf_box(box: Box) -> Box:
    box.write("report.pdf", make_pdf(["Alpha page one.", "Bravo page two.", "Charlie page three."]))
    return box


async def test_pdf_whole_document_has_page_references(pdf_box: Box) -> None:
    result = await read(pdf_box.ctx(), pdf_box.p("report.pdf"))
    body = text_of(result)
    assert result.data["pageCount"] == 3 and result.data["pages"] == [1, 3]
    assert body.index("[page 1]\n[block 1] Alpha") < body.index("[page 2]\n[block 2] Bravo")
    assert body.index("[page 2]\n[block 2] Bravo") < body.index("[page 3]\n[block 3] Charlie")
    assert result.data["blockCount"] == 3 and result.data["blocks"] == [1, 3]


async def test_pdf_one_page(pdf_box: Box) -> None:
    result = await read(pdf_box.ctx(), pdf_box.p("report.pdf"), page=2)
    body = text_of(result)
    assert "[page 2]\n[block 2] Bravo page two." in body and "Alpha" not in body and "Charlie" not in body
    assert result.data["pages"] == [2, 2] and "PDF with 3 page(s) and 3 block(s); page 2." in body


async def test_pdf_page_range(pdf_box: Box) -> None:
    result = await read(pdf_box.ctx(), pdf_box.p("report.pdf"), page=1, pageEnd=2)
    body = text_of(result)
    assert "Alpha" in body and "Bravo" in body and "Charlie" not in body
    assert result.data["pages"] == [1, 2]


async def test_pdf_out_of_range_pages_fail_clearly(pdf_box: Box) -> None:
    ctx = pdf_box.ctx()
    nine = await read(ctx, pdf_box.p("report.pdf"), page=9)
    assert nine.is_error and "page 9 is out of range: the PDF has 3 page(s), 1-3" in text_of(nine)
    end = await read(ctx, pdf_box.p("report.pdf"), page=2, pageEnd=4)
    assert end.is_error and "pageEnd 4 is out of range" in text_of(end)
    backwards = await read(ctx, pdf_box.p("report.pdf"), page=3, pageEnd=2)
    assert backwards.is_error and "before page 3" in text_of(backwards)
    block = await read(ctx, pdf_box.p("report.pdf"), block=4)
    assert block.is_error and "block 4 is out of range: the document has 3 block(s), 1-3" in text_of(block)
    both = await read(ctx, pdf_box.p("report.pdf"), block=1, page=1)
    assert both.is_error and "either page/pageEnd or block" in text_of(both)
    heading = await read(ctx, pdf_box.p("report.pdf"), heading="Intro")
    assert heading.is_error and "by page" in text_of(heading)
    assert pdf_box.p("report.pdf") not in ctx.reads  # failed reads record nothing


async def test_long_pdf_text_is_windowed_with_the_same_pages(box: Box) -> None:
    words = " ".join(f"word{n}" for n in range(3000))  # flows over several pages
    box.write("long.pdf", make_pdf([words]))
    ctx = box.ctx()
    first = await read(ctx, box.p("long.pdf"), page=1, pageEnd=4)
    assert first.data["pageCount"] > 4 and first.data["nextOffset"] == READ_WINDOW_CHARS
    assert f"Use offset={READ_WINDOW_CHARS}, page=1, pageEnd=4 to continue." in text_of(first)
    second = await read(ctx, box.p("long.pdf"), page=1, pageEnd=4, offset=READ_WINDOW_CHARS)
    assert not second.is_error and second.data["offset"] == READ_WINDOW_CHARS
    assert text_of(first).split("\n\n[Showing")[0][-20:] not in text_of(second)[:200]


async def test_pdf_size_limit_boundary(local: Box) -> None:
    header = b"%PDF-1.4\n"
    local.write("at-limit.pdf", header + b"0" * (MAX_DOCUMENT_BYTES - len(header)))
    local.write("over-limit.pdf", header + b"0" * (MAX_DOCUMENT_BYTES - len(header) + 1))
    ctx = local.ctx()
    at = await read(ctx, local.p("at-limit.pdf"))
    assert at.is_error and "not a readable PDF" in text_of(at)  # parsed (and found broken), not refused
    over = await read(ctx, local.p("over-limit.pdf"))
    assert over.is_error and f"the largest PDF read accepts is {MAX_DOCUMENT_BYTES} bytes" in text_of(over)


# --- DOCX -----------------------------------------------------------------------------------------------


@pytest.fixture
def docx_box(box: Box) -> Box:
    box.write("handbook.docx", make_docx())
    return box


async def test_docx_whole_document_is_numbered_blocks(docx_box: Box) -> None:
    result = await read(docx_box.ctx(), docx_box.p("handbook.docx"))
    body = text_of(result)
    assert result.data["blockCount"] == 8
    assert "[block 1, title] Handbook" in body
    assert "[block 2, heading 1] Intro" in body
    assert "[block 3] Welcome to the team." in body
    assert "[block 6, table]\nname | role\nAda | engineer" in body
    assert "[block 8] Twenty days a year." in body


async def test_docx_one_block(docx_box: Box) -> None:
    result = await read(docx_box.ctx(), docx_box.p("handbook.docx"), block=6)
    body = text_of(result)
    assert "Ada | engineer" in body and "Welcome" not in body
    assert result.data["blocks"] == [6, 6]


async def test_docx_heading_section_runs_to_the_next_heading_of_its_level(docx_box: Box) -> None:
    result = await read(docx_box.ctx(), docx_box.p("handbook.docx"), heading="intro")
    body = text_of(result)
    assert (
        "Welcome" in body and "We use Python." in body and "Ada | engineer" in body
    )  # includes its sub-section
    assert "Holidays" not in body and "Handbook" not in body
    assert result.data["blocks"] == [2, 6]
    sub = await read(docx_box.ctx(), docx_box.p("handbook.docx"), heading="Tools")
    assert sub.data["blocks"] == [4, 6]


async def test_docx_out_of_range_and_unknown_heading_fail_clearly(docx_box: Box) -> None:
    ctx = docx_box.ctx()
    far = await read(ctx, docx_box.p("handbook.docx"), block=9)
    assert far.is_error and "block 9 is out of range: the document has 8 block(s), 1-8" in text_of(far)
    missing = await read(ctx, docx_box.p("handbook.docx"), heading="Salaries")
    assert missing.is_error and "no heading matches 'Salaries'" in text_of(missing)
    assert "'Holidays' (block 7)" in text_of(missing)
    page = await read(ctx, docx_box.p("handbook.docx"), page=1)
    assert page.is_error and "by block or heading" in text_of(page)


async def test_broken_docx_fails_clearly(box: Box) -> None:
    box.write("broken.docx", b"not a zip at all")
    result = await read(box.ctx(), box.p("broken.docx"))
    assert result.is_error and "not a readable DOCX" in text_of(result)


# --- images ------------------------------------------------------------------------------------------


async def test_png_comes_back_as_an_image_block(box: Box) -> None:
    data = make_png()
    box.write("dot.png", data)
    for tool in (READ, READ_IMAGE):
        params = ReadParams(path=box.p("dot.png")) if tool is READ else ReadImageParams(path=box.p("dot.png"))
        result = await tool.run(box.ctx(), params)
        assert not result.is_error
        image = result.content[1]
        assert isinstance(result.content[0], TextBlock) and isinstance(image, ImageBlock)
        assert image.media_type == "image/png" and base64.b64decode(image.data) == data


@pytest.mark.parametrize(
    ("name", "head", "media"),
    [
        ("a.jpg", b"\xff\xd8\xff\xe0" + b"\x00" * 16, "image/jpeg"),
        ("a.jpeg", b"\xff\xd8\xff\xdb" + b"\x00" * 16, "image/jpeg"),
        ("a.gif", b"GIF89a" + b"\x00" * 16, "image/gif"),
        ("a.webp", b"RIFF\x10\x00\x00\x00WEBPVP8 " + b"\x00" * 8, "image/webp"),
    ],
)
async def test_other_image_types(local: Box, name: str, head: bytes, media: str) -> None:
    local.write(name, head)
    result = await read(local.ctx(), local.p(name))
    assert isinstance(result.content[1], ImageBlock) and result.content[1].media_type == media


async def test_image_size_boundary(local: Box) -> None:
    local.write("at.png", PNG_SIGNATURE + b"\x00" * (MAX_IMAGE_BYTES - len(PNG_SIGNATURE)))
    local.write("over.png", PNG_SIGNATURE + b"\x00" * (MAX_IMAGE_BYTES - len(PNG_SIGNATURE) + 1))
    ctx = local.ctx()
    at = await read(ctx, local.p("at.png"))
    assert not at.is_error and at.data["bytes"] == MAX_IMAGE_BYTES
    over = await read(ctx, local.p("over.png"))
    assert over.is_error and f"the largest image read accepts is {MAX_IMAGE_BYTES} bytes" in text_of(over)


async def test_svg_is_refused(box: Box) -> None:
    box.write("logo.svg", '<svg xmlns="http://www.w3.org/2000/svg"><circle r="4"/></svg>')
    box.write("drawing.xml", '<?xml version="1.0"?>\n<svg xmlns="http://www.w3.org/2000/svg"></svg>')
    for name in ("logo.svg", "drawing.xml"):
        for result in (
            await read(box.ctx(), box.p(name)),
            await READ_IMAGE.run(box.ctx(), ReadImageParams(path=box.p(name))),
        ):
            assert result.is_error and "SVG" in text_of(result) and "vector" in text_of(result)


async def test_a_png_name_without_png_bytes_is_refused(box: Box) -> None:
    box.write("fake.png", "just text")
    result = await read(box.ctx(), box.p("fake.png"))
    assert result.is_error and "not a PNG, JPEG, GIF or WebP image" in text_of(result)


async def test_read_image_refuses_other_files(box: Box) -> None:
    box.write("notes.md", "# notes")
    result = await READ_IMAGE.run(box.ctx(), ReadImageParams(path=box.p("notes.md")))
    assert result.is_error and "not an image" in text_of(result)


# --- refusals, limits, bookkeeping --------------------------------------------------------------------


async def test_binary_files_get_a_short_descriptor(box: Box) -> None:
    box.write("prog", b"\x7fELF\x02\x01\x01" + b"\x00" * 100)
    box.write("blob.dat", b"abc\x00def")
    ctx = box.ctx()
    elf = await read(ctx, box.p("prog"))
    assert elf.is_error and "binary file (ELF executable or library, 107 bytes)" in text_of(elf)
    blob = await read(ctx, box.p("blob.dat"))
    assert blob.is_error and "binary data" in text_of(blob)


async def test_text_size_boundary(local: Box) -> None:
    local.write("at.log", b"a" * MAX_TEXT_BYTES)
    local.write("over.log", b"a" * (MAX_TEXT_BYTES + 1))
    ctx = local.ctx()
    at = await read(ctx, local.p("at.log"))
    assert not at.is_error and at.data["totalChars"] == MAX_TEXT_BYTES
    over = await read(ctx, local.p("over.log"))
    assert over.is_error and f"the largest text file read accepts is {MAX_TEXT_BYTES} bytes" in text_of(over)


async def test_folders_and_missing_files(box: Box) -> None:
    box.h("sub").mkdir()
    ctx = box.ctx()
    folder = await read(ctx, box.p("sub"))
    assert folder.is_error and "is a folder; use list" in text_of(folder)
    missing = await read(ctx, box.p("nope.txt"))
    assert missing.is_error and "does not exist" in text_of(missing)


async def test_a_read_records_the_fingerprint_of_what_was_read(box: Box) -> None:
    path = box.write("seen.txt", "version 1")
    ctx = box.ctx()
    await read(ctx, box.p("seen.txt"))
    assert ctx.reads == {box.p("seen.txt"): host_fingerprint(path)}
    assert ctx.reads[box.p("seen.txt")] != ABSENT


# Host files only: through the protocol a path is lexical, so the key is the link's own path.
async def test_reads_through_a_link_record_the_target(host_box: Box) -> None:
    box = host_box
    box.write("target.txt", "linked")
    os.symlink("target.txt", box.h("link.txt"))
    ctx = box.ctx()
    result = await read(ctx, box.p("link.txt"))
    assert text_of(result) == "linked"
    assert list(ctx.reads) == [box.p("target.txt")]


# --- outside the workspace root -----------------------------------------------------------------------


async def test_external_read_asks_first_and_returns_the_refusal(local: Box, tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("secret plans")
    denied = local.ctx(allow_external=False)
    result = await read(denied, str(outside))
    assert result.is_error and text_of(result) == DENIED
    assert denied.asked == [(Action.READ_EXTERNAL, "read", {"path": str(outside)})]
    assert denied.reads == {}
    allowed = local.ctx()
    assert text_of(await read(allowed, str(outside))) == "secret plans"
    inside = local.write("in.txt", "here")
    assert text_of(await read(allowed, str(inside))) == "here"
    assert len(allowed.asked) == 1  # reads inside the root never ask


async def test_a_link_leading_out_of_the_root_asks_too(local: Box, tmp_path: Path) -> None:
    (tmp_path / "elsewhere.txt").write_text("out there")
    os.symlink(tmp_path / "elsewhere.txt", local.h("sneaky.txt"))
    ctx = local.ctx(allow_external=False)
    result = await read(ctx, local.p("sneaky.txt"))
    assert result.is_error and ctx.asked[0][2] == {"path": str(tmp_path / "elsewhere.txt")}


async def test_images_outside_the_root_are_refused_without_asking(local: Box, tmp_path: Path) -> None:
    (tmp_path / "photo.png").write_bytes(make_png())
    ctx = local.ctx()
    result = await read(ctx, str(tmp_path / "photo.png"))
    assert result.is_error and "images are read only from inside" in text_of(result)
    assert ctx.asked == []


async def test_sandbox_system_files_are_outside_the_root(sandbox: SandboxMachine, tmp_path: Path) -> None:
    ctx = Ctx(sandbox, allow_external=False)
    result = await read(ctx, "/etc/passwd")
    assert result.is_error and ctx.asked == [(Action.READ_EXTERNAL, "read", {"path": "/etc/passwd"})]
    ctx.allow_external = True
    passwd = await read(ctx, "/etc/passwd")
    inside = await sandbox.exec(ExecRequest(command="cat /etc/passwd"))
    assert text_of(passwd) == inside.stdout.decode()


async def test_paths_outside_what_the_sandbox_exposes_fail_clearly(
    sandbox: SandboxMachine, tmp_path: Path
) -> None:
    ctx = Ctx(sandbox)
    result = await read(ctx, "/opt/anything.txt")
    assert result.is_error and "outside what this machine exposes" in text_of(result)


async def test_read_returns_what_the_sandbox_sees(sandbox: SandboxMachine, tmp_path: Path) -> None:
    box = sandbox_box(sandbox, tmp_path)
    made = await sandbox.exec(ExecRequest(command=f"printf 'made inside\\n' > {box.p('inside.txt')}"))
    assert made.exit_code == 0, made.stderr
    result = await read(box.ctx(), box.p("inside.txt"))
    assert text_of(result) == "made inside\n"
