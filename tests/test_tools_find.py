"""`list`, `glob` and `grep` against a real sandbox, a local and an ssh machine, caps at their boundaries."""

from __future__ import annotations

import posixpath
from pathlib import Path
from typing import Any

import pytest
from test_tools_read import DENIED, Box, box, docker, e2b, host_box, local, make_png, sandbox, ssh, text_of

from agentbox.tools.base import Action, ToolResult
from agentbox.tools.find import (
    GLOB,
    GREP,
    LIST,
    MAX_GLOB_PATHS,
    MAX_GREP_COUNTED,
    MAX_GREP_MATCHES,
    MAX_LINE_CHARS,
    MAX_LIST_ENTRIES,
    GlobParams,
    GrepParams,
    ListParams,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")
# fixtures shared with test_tools_read
__all__ = ["box", "docker", "e2b", "host_box", "local", "sandbox", "ssh"]


async def list_(b: Box, path: str, **params: Any) -> ToolResult:
    return await LIST.run(b.ctx(), ListParams(path=path, **params))


async def glob(b: Box, pattern: str, path: str, **params: Any) -> ToolResult:
    return await GLOB.run(b.ctx(), GlobParams(pattern=pattern, path=path, **params))


async def grep(b: Box, pattern: str, path: str, **params: Any) -> ToolResult:
    return await GREP.run(b.ctx(), GrepParams(pattern=pattern, path=path, **params))


def many(b: Box, folder: str, count: int, name: str = "f{:04d}.txt", content: str = "") -> None:
    b.mkdir(folder)
    for n in range(count):
        b.write(posixpath.join(folder, name.format(n)), content)


# --- list ------------------------------------------------------------------------------------------


async def test_list_shows_folders_first_with_sizes_and_kinds(box: Box) -> None:
    box.write("docs/readme.md", "# hi")
    box.write("docs/report.pdf", b"%PDF-1.4")
    box.write("docs/photo.png", make_png())
    box.write("docs/.env", "SECRET=1")
    box.mkdir("docs/archive")
    result = await list_(box, box.p("docs"))
    lines = text_of(result).splitlines()
    assert lines[0] == f"{box.p('docs')}:"
    assert lines[1] == "archive/"
    assert ".env  (8 bytes)" in lines
    assert "readme.md  (4 bytes, markdown)" in lines
    assert "report.pdf  (8 bytes, pdf: read by page or block)" in lines
    assert any(line.startswith("photo.png") and "image: view it with read" in line for line in lines)
    assert result.data["total"] == 5


async def test_list_file_type_filter(box: Box) -> None:
    box.write("d/a.md", "a")
    box.write("d/b.markdown", "b")
    box.write("d/c.txt", "c")
    box.write("d/script.py", "d")
    box.mkdir("d/sub")
    markdown = text_of(await list_(box, box.p("d"), fileType="markdown"))
    assert (
        "a.md" in markdown and "b.markdown" in markdown and "c.txt" not in markdown and "sub/" not in markdown
    )
    py = text_of(await list_(box, box.p("d"), fileType=".py"))
    assert "script.py" in py and "a.md" not in py
    none = await list_(box, box.p("d"), fileType="pdf")
    assert "no entries of type pdf" in text_of(none)


async def test_list_cap_boundary(box: Box) -> None:
    many(box, "full", MAX_LIST_ENTRIES)
    many(box, "over", MAX_LIST_ENTRIES + 1)
    full = await list_(box, box.p("full"))
    assert full.data["shown"] == MAX_LIST_ENTRIES and "Narrow your search" not in text_of(full)
    over = await list_(box, box.p("over"))
    assert over.data["shown"] == MAX_LIST_ENTRIES and over.data["truncated"]
    assert text_of(over).endswith(
        f"[Showing {MAX_LIST_ENTRIES} of {MAX_LIST_ENTRIES + 1} entries. "
        "Narrow your search with query, prefix or fileType, or list a subfolder.]"
    )


async def test_list_query_searches_below_and_respects_gitignore(box: Box) -> None:
    box.write(".gitignore", "build/\n")
    box.write("src/Budget-2024.xlsx", "x")
    box.write("notes/budget.md", "x")
    box.write("build/budget.md", "x")
    box.write("notes/other.md", "x")
    result = await list_(box, box.p(), query="BUDGET")
    body = text_of(result)
    assert box.p("src/Budget-2024.xlsx") in body and box.p("notes/budget.md") in body
    assert "build/" not in body and "other.md" not in body
    typed = text_of(await list_(box, box.p(), query="budget", fileType="markdown"))
    assert box.p("notes/budget.md") in typed and "xlsx" not in typed
    none = await list_(box, box.p(), query="nothing-like-this")
    assert "no entries matching 'nothing-like-this'" in text_of(none)


async def test_list_query_cap_boundary(local: Box) -> None:
    many(local, "a", MAX_LIST_ENTRIES, name="hit{:04d}.txt")
    many(local, "b", MAX_LIST_ENTRIES + 1, name="hit{:04d}.txt")
    full = await list_(local, local.p("a"), query="hit")
    assert full.data["shown"] == MAX_LIST_ENTRIES and not full.data["truncated"]
    over = await list_(local, local.p("b"), query="hit")
    assert f"[Showing {MAX_LIST_ENTRIES} of {MAX_LIST_ENTRIES + 1} entries." in text_of(over)


async def test_list_refuses_files_and_missing_folders(box: Box) -> None:
    box.write("file.txt", "x")
    assert "not a folder" in text_of(await list_(box, box.p("file.txt")))
    assert "does not exist" in text_of(await list_(box, box.p("missing")))


# --- glob -------------------------------------------------------------------------------------------


async def test_glob_matches_names_at_any_depth_and_paths_relative_to_path(box: Box) -> None:
    box.write("a.py", "")
    box.write("src/b.py", "")
    box.write("src/deep/c.py", "")
    box.write("src/d.txt", "")
    anywhere = text_of(await glob(box, "*.py", box.p()))
    assert anywhere.splitlines() == [box.p("a.py"), box.p("src/b.py"), box.p("src/deep/c.py")]
    direct = text_of(await glob(box, "src/*.py", box.p()))
    assert direct.splitlines() == [box.p("src/b.py")]
    below = text_of(await glob(box, "*.py", box.p("src/deep")))
    assert below.splitlines() == [box.p("src/deep/c.py")]


async def test_glob_respects_gitignore_and_hides_dotfiles_unless_named(box: Box) -> None:
    box.write(".gitignore", "dist/\n*.log\n")
    box.write("dist/out.js", "")
    box.write("app.js", "")
    box.write("debug.log", "")
    box.write(".github/ci.yml", "")
    assert text_of(await glob(box, "*.js", box.p())).splitlines() == [box.p("app.js")]
    assert text_of(await glob(box, "*.log", box.p())) == "No files found matching pattern."
    assert text_of(await glob(box, "*.yml", box.p())) == "No files found matching pattern."
    assert text_of(await glob(box, ".github/*.yml", box.p())).splitlines() == [box.p(".github/ci.yml")]


async def test_glob_cap_boundary(box: Box) -> None:
    many(box, "full", MAX_GLOB_PATHS)
    many(box, "over", MAX_GLOB_PATHS + 1)
    full = await glob(box, "*.txt", box.p("full"))
    assert full.data["shown"] == MAX_GLOB_PATHS and not full.data["truncated"]
    assert "Narrow" not in text_of(full)
    over = await glob(box, "*.txt", box.p("over"))
    assert over.data["shown"] == MAX_GLOB_PATHS and over.data["total"] == MAX_GLOB_PATHS + 1
    assert text_of(over).endswith(
        f"[Showing {MAX_GLOB_PATHS} of {MAX_GLOB_PATHS + 1} paths. "
        "Narrow your search with a more specific pattern or path.]"
    )


async def test_glob_bad_input(box: Box) -> None:
    assert (await glob(box, "/abs/*.py", box.p())).is_error
    assert (await glob(box, "  ", box.p())).is_error
    box.write("f.txt", "")
    assert "not a folder" in text_of(await glob(box, "*", box.p("f.txt")))


# --- grep -------------------------------------------------------------------------------------------


async def test_grep_lines_are_path_line_text(box: Box) -> None:
    box.write("src/app.py", "import os\n\ndef main():\n    print(os.getcwd())\n")
    box.write("src/util.py", "def helper():\n    pass\n")
    result = await grep(box, r"def \w+\(", box.p())
    assert text_of(result).splitlines() == [
        f"{box.p('src/app.py')}:3:def main():",
        f"{box.p('src/util.py')}:1:def helper():",
    ]
    assert text_of(await grep(box, "nothing here", box.p())) == "No matches found."


async def test_grep_options(box: Box) -> None:
    box.write("a.py", "Value = f(x)\nvalue = 2\n")
    box.write("b.txt", "value = 3\n")
    literal = text_of(await grep(box, "f(x)", box.p(), literal=True))
    assert literal == f"{box.p('a.py')}:1:Value = f(x)"
    insensitive = text_of(await grep(box, "^value", box.p(), caseInsensitive=True, include="*.py"))
    assert insensitive.splitlines() == [f"{box.p('a.py')}:1:Value = f(x)", f"{box.p('a.py')}:2:value = 2"]
    one_file = text_of(await grep(box, "value", box.p("b.txt")))
    assert one_file == f"{box.p('b.txt')}:1:value = 3"


async def test_grep_respects_gitignore(box: Box) -> None:
    box.write(".gitignore", "vendor/\n")
    box.write("vendor/lib.js", "needle\n")
    box.write("main.js", "needle\n")
    assert text_of(await grep(box, "needle", box.p())) == f"{box.p('main.js')}:1:needle"


async def test_grep_match_cap_boundary(box: Box) -> None:
    box.write("full.txt", "hit\n" * MAX_GREP_MATCHES)
    box.write("over.txt", "hit\n" * (MAX_GREP_MATCHES + 1))
    full = await grep(box, "hit", box.p("full.txt"))
    assert full.data["shown"] == MAX_GREP_MATCHES and "Narrow" not in text_of(full)
    over = await grep(box, "hit", box.p("over.txt"))
    assert len(text_of(over).split("\n\n")[0].splitlines()) == MAX_GREP_MATCHES
    assert text_of(over).endswith(
        f"\n\n[Showing {MAX_GREP_MATCHES} of {MAX_GREP_MATCHES + 1} matches. Narrow your search.]"
    )


async def test_grep_counts_up_to_a_ceiling(local: Box) -> None:
    local.write("huge.txt", "hit\n" * (MAX_GREP_COUNTED + 5))
    result = await grep(local, "hit", local.p("huge.txt"))
    assert text_of(result).endswith(
        f"[Showing {MAX_GREP_MATCHES} of more than {MAX_GREP_COUNTED} matches. Narrow your search.]"
    )


async def test_grep_line_length_boundary(box: Box) -> None:
    at = "a" * (MAX_LINE_CHARS - 1) + "Z"
    over = "b" * MAX_LINE_CHARS + "Z"
    box.write("at.txt", at + "\n")
    box.write("over.txt", over + "\n")
    assert text_of(await grep(box, "Z", box.p("at.txt"))) == f"{box.p('at.txt')}:1:{at}"
    cut = text_of(await grep(box, "Z", box.p("over.txt")))
    assert cut == f"{box.p('over.txt')}:1:{'b' * MAX_LINE_CHARS}..."


async def test_grep_bad_regex_and_missing_path(box: Box) -> None:
    box.write("f.txt", "x\n")
    bad = await grep(box, "(unclosed", box.p())
    assert bad.is_error and text_of(bad).startswith("grep failed:")
    missing = await grep(box, "x", box.p("nope"))
    assert missing.is_error and "does not exist" in text_of(missing)


# --- outside the workspace root ---------------------------------------------------------------------


async def test_searching_outside_the_root_asks_first(local: Box, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "notes.txt").write_text("needle\n")
    for tool, params in (
        (LIST, ListParams(path=str(outside))),
        (GLOB, GlobParams(pattern="*.txt", path=str(outside))),
        (GREP, GrepParams(pattern="needle", path=str(outside))),
    ):
        denied = local.ctx(allow_external=False)
        result = await tool.run(denied, params)
        assert result.is_error and text_of(result) == DENIED
        assert denied.asked == [(Action.READ_EXTERNAL, tool.name, {"path": str(outside)})]
        allowed = local.ctx()
        assert "notes.txt" in text_of(await tool.run(allowed, params))
    inside = local.ctx(allow_external=False)
    await LIST.run(inside, ListParams())
    assert inside.asked == []
