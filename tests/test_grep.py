"""grep and search_in_file with the real rg on real trees: seed 002's TODO, context
assembly, filters, paging, symlinks, paths mapped back, limits at their boundaries, and rg
never outliving the call (timeout, cancel)."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest
from conftest import APP, SandboxFactory

from agentbox.machines.binaries import ripgrep_binary as rg_binary
from agentbox.machines.local import LocalMachine
from agentbox.workspace.errors import WorkspaceError
from agentbox.workspace.grep import (
    GREP_RESULTS_CEILING,
    LINE_TRUNCATED_MARKER,
    MAX_GREP_CONTEXT_LINES,
    MAX_GREP_RESULTS,
    MAX_LINE_CHARS,
    MAX_RECORD_BYTES,
    GrepMatch,
    grep,
    search_in_file,
)


@pytest.fixture
def machine(tmp_path: Path) -> LocalMachine:
    return LocalMachine("local", tmp_path / "root")


@pytest.fixture
def root(machine: LocalMachine) -> Path:
    return Path(machine.root)


def write(path: Path, data: str | bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return str(path)


async def failure(coro: object) -> WorkspaceError:
    with pytest.raises(WorkspaceError) as info:
        await coro  # type: ignore[misc]
    return info.value


def rg_pids_in(directory: Path) -> list[int]:
    """rg processes whose working directory is `directory` (grep runs rg there)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry}/cwd") == str(directory) and os.readlink(
                f"/proc/{entry}/exe"
            ) == os.path.realpath(rg_binary()):
                pids.append(int(entry))
        except OSError:
            continue
    return pids


async def wait_for(condition: object, deadline: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline
    while not condition():  # type: ignore[operator]
        assert loop.time() < end, "condition not reached in time"
        await asyncio.sleep(0.01)


# --- seed 002 --------------------------------------------------------------------------


async def test_seed_todo_in_one_file(machine: LocalMachine, root: Path) -> None:
    target = write(root / "demo/src/app.py", APP)
    result = await grep(machine, target, "TODO.*")
    assert [(m.line_number, m.line_content) for m in result.matches] == [
        (4, "    # TODO: read the input path from argv")
    ]
    assert result.matches[0].file == target
    assert (result.path, result.pattern, result.match_count, result.files_matched) == (target, "TODO.*", 1, 1)
    assert not result.truncated


async def test_tree_paths_map_back_to_inside_paths(make_sandbox: SandboxFactory) -> None:
    machine = await make_sandbox()
    workspace = machine.workspace
    write(workspace / "src/app.py", APP)
    write(workspace / "README.md", "# demo\nTODO: docs\n")
    result = await grep(machine, "/workspace", "TODO")
    assert result.path == "/workspace"
    assert [(m.file, m.line_number) for m in result.matches] == [
        ("/workspace/README.md", 2),
        ("/workspace/src/app.py", 4),
    ]
    relative = await grep(machine, "src", "TODO")
    assert [m.file for m in relative.matches] == ["/workspace/src/app.py"]


# --- context ---------------------------------------------------------------------------


async def test_overlapping_contexts_go_to_every_match(machine: LocalMachine, root: Path) -> None:
    target = write(root / "c.txt", "l1\nl2\nHIT3\nl4\nHIT5\nl6\nl7\nl8\nl9\n")
    result = await grep(machine, target, "HIT", context_before=2, context_after=2)
    first, second = result.matches
    assert (first.line_number, first.context_before, first.context_after) == (3, ["l1", "l2"], ["l4", "HIT5"])
    assert (second.line_number, second.context_before, second.context_after) == (
        5,
        ["HIT3", "l4"],
        ["l6", "l7"],
    )


async def test_context_stops_at_file_edges_and_between_files(machine: LocalMachine, root: Path) -> None:
    write(root / "t/a.txt", "HIT\nafter\n")
    write(root / "t/b.txt", "before\nHIT\n")
    result = await grep(machine, str(root / "t"), "HIT", context_before=3, context_after=3)
    assert [(m.context_before, m.context_after) for m in result.matches] == [
        ([], ["after"]),
        (["before"], []),
    ]


async def test_multiline_match_and_its_context(machine: LocalMachine, root: Path) -> None:
    target = write(root / "m.txt", "zero\nstart\nend\nafter\n")
    result = await grep(machine, target, r"start\nend", multiline=True, context_before=1, context_after=1)
    (match,) = result.matches
    assert (match.line_number, match.line_content) == (2, "start\nend")
    assert (match.context_before, match.context_after) == (["zero"], ["after"])


# --- filters ---------------------------------------------------------------------------


async def test_include_exclude_globs(machine: LocalMachine, root: Path) -> None:
    for name in ("a.py", "sub/b.py", "sub/deep/c.py", "d.txt"):
        write(root / "g" / name, "needle\n")
    base = root / "g"

    async def files(**kw: object) -> list[str]:
        result = await grep(machine, str(base), "needle", **kw)  # type: ignore[arg-type]
        return [os.path.relpath(m.file, base) for m in result.matches]

    assert await files(include="*.py") == ["a.py", "sub/b.py", "sub/deep/c.py"]
    assert await files(include=["*.py"], exclude=["sub/deep/**"]) == ["a.py", "sub/b.py"]
    assert await files(exclude="*.py") == ["d.txt"]
    assert await files(file_type="py", recursive=False) == ["a.py"]
    err = await failure(grep(machine, str(base), "needle", file_type="no-such-type"))
    assert err.error_type == "bad_request" and "no-such-type" in err.message


async def test_case_and_fixed_strings(machine: LocalMachine, root: Path) -> None:
    target = write(root / "f.txt", "Hello\nhello\na.b(c\naxb(c\n")
    assert len((await grep(machine, target, "hello")).matches) == 1
    assert len((await grep(machine, target, "hello", case_insensitive=True)).matches) == 2
    fixed = await grep(machine, target, "a.b(c", fixed_strings=True)
    assert [m.line_content for m in fixed.matches] == ["a.b(c"]


async def test_invalid_regex_is_bad_request(machine: LocalMachine, root: Path) -> None:
    target = write(root / "f.txt", "x\n")
    err = await failure(grep(machine, target, "a.b(c"))
    assert (err.error_type, err.operation) == ("bad_request", "grep")
    assert "regex parse error" in err.message


async def test_hidden_and_gitignore(machine: LocalMachine, root: Path) -> None:
    base = root / "h"
    write(base / ".hidden/x.txt", "needle\n")
    write(base / "ignored.log", "needle\n")
    write(base / "kept.txt", "needle\n")
    write(base / ".gitignore", "*.log\n")

    async def files(hidden: bool = False, respect_gitignore: bool = True) -> set[str]:
        result = await grep(machine, str(base), "needle", hidden=hidden, respect_gitignore=respect_gitignore)
        return {os.path.relpath(m.file, base) for m in result.matches}

    assert await files() == {"kept.txt"}
    assert await files(hidden=True) == {"kept.txt", ".hidden/x.txt"}
    assert await files(respect_gitignore=False) == {"kept.txt", "ignored.log"}


async def test_symlink_out_of_the_tree_is_not_followed(make_sandbox: SandboxFactory, tmp_path: Path) -> None:
    machine = await make_sandbox()
    workspace = machine.workspace
    write(tmp_path / "outside/secret.txt", "needle\n")
    write(workspace / "inside.txt", "needle\n")
    (workspace / "link.txt").symlink_to(tmp_path / "outside/secret.txt")
    (workspace / "linkdir").symlink_to(tmp_path / "outside")
    (workspace / "up").symlink_to("/workspace/..")
    result = await grep(machine, "/workspace", "needle")
    assert [m.file for m in result.matches] == ["/workspace/inside.txt"]


async def test_max_file_size(machine: LocalMachine, root: Path) -> None:
    base = root / "s"
    write(base / "small.txt", "needle\n")
    write(base / "large.txt", "needle\n" + "x" * 2000 + "\n")
    found = await grep(machine, str(base), "needle", max_file_size="1K")
    assert [os.path.basename(m.file) for m in found.matches] == ["small.txt"]
    assert len((await grep(machine, str(base), "needle", max_file_size=10_000)).matches) == 2
    assert (
        await failure(grep(machine, str(base), "needle", max_file_size="big"))
    ).error_type == "bad_request"


# --- paging and limits -----------------------------------------------------------------


async def test_max_results_boundary(machine: LocalMachine, root: Path) -> None:
    target = write(root / "five.txt", "hit\n" * 5)
    exact = await grep(machine, target, "hit", max_results=5)
    assert (exact.match_count, exact.truncated) == (5, False)
    short = await grep(machine, target, "hit", max_results=4)
    assert (short.match_count, short.truncated) == (4, True)


async def test_truncation_seen_in_a_later_file(machine: LocalMachine, root: Path) -> None:
    write(root / "p/a.txt", "hit\nhit\n")
    write(root / "p/b.txt", "nothing\n")
    write(root / "p/c.txt", "hit\n")
    result = await grep(machine, str(root / "p"), "hit", max_results=2, context_after=1)
    assert (result.match_count, result.truncated, result.files_matched) == (2, True, 1)
    assert result.matches[0].context_after == ["hit"]
    whole = await grep(machine, str(root / "p"), "hit", max_results=3)
    assert (whole.truncated, whole.files_matched) == (False, 2)


async def test_offset_pages_cover_everything_once(machine: LocalMachine, root: Path) -> None:
    for n in range(3):
        write(root / f"o/f{n}.txt", "".join(f"hit {n}.{i}\n" for i in range(4)))
    base = str(root / "o")
    everything = [m.line_content for m in (await grep(machine, base, "hit")).matches]
    assert len(everything) == 12
    pages = []
    for offset in range(0, 12, 5):
        page = await grep(machine, base, "hit", max_results=5, offset=offset)
        pages += [m.line_content for m in page.matches]
        assert page.truncated == (offset + 5 < 12)
    assert pages == everything


#: Names that order differently by whole path string than by component (`a/x` vs `a.txt`,
#: `a-b`), by case, beyond ASCII, and one that is not UTF-8.
TRICKY_NAMES = ["a/x.txt", "a.txt", "a-b/x.txt", "a/b/c.txt", "B.txt", "b.txt", "é/x.txt", "z", "~"]


def tricky_tree(root: Path, copies: int) -> Path:
    base = root / "t"
    for n, name in enumerate(TRICKY_NAMES):
        for copy in range(copies):
            write(base / f"d{copy:02d}" / name, "".join(f"hit {n}.{copy}.{i}\n" for i in range(3)))
    (base / "d00").joinpath(os.fsdecode(b"raw\xff.txt")).write_bytes(b"hit raw\n")
    return base


def rg_sorted_files(base: Path) -> list[str]:
    """The files holding `hit`, in the order `rg --sort path` (single-threaded) gives them."""
    argv = [rg_binary(), "--files-with-matches", "--sort", "path", "--no-config", "hit", str(base)]
    out = subprocess.run(argv, capture_output=True, check=True).stdout
    return [os.fsdecode(line) for line in out.splitlines()]


def files_in_order(matches: list[GrepMatch]) -> list[str]:
    return list(dict.fromkeys(m.file for m in matches))


async def test_parallel_results_come_in_rg_sorted_path_order(machine: LocalMachine, root: Path) -> None:
    base = tricky_tree(root, copies=12)
    result = await grep(machine, str(base), "hit", max_results=GREP_RESULTS_CEILING)
    assert files_in_order(result.matches) == rg_sorted_files(base)
    assert [m.line_number for m in result.matches[:3]] == [1, 2, 3]


async def test_pages_and_truncation_match_the_sorted_fallback(machine: LocalMachine, root: Path) -> None:
    """Sorting everything (parallel) and stopping early (`--sort path`, past the memory limit)
    give the same pages, truncation and file counts."""
    base = str(tricky_tree(root, copies=4))
    for offset, limit, after in ((0, 5, 0), (7, 10, 2), (100, 20, 1), (0, 1000, 0)):
        kwargs = {"offset": offset, "max_results": limit, "context_after": after}
        parallel = await grep(machine, base, "hit", **kwargs)  # type: ignore[arg-type]
        fallback = await grep(machine, base, "hit", unsorted_limit=1, **kwargs)  # type: ignore[arg-type]
        assert parallel == fallback
        assert parallel.truncated == (offset + limit < 9 * 4 * 3 + 1)


async def test_request_limits(machine: LocalMachine, root: Path) -> None:
    target = write(root / "l.txt", "x\n")
    assert MAX_GREP_RESULTS == 500
    await grep(machine, target, "x", max_results=GREP_RESULTS_CEILING)
    await grep(
        machine, target, "x", context_before=MAX_GREP_CONTEXT_LINES, context_after=MAX_GREP_CONTEXT_LINES
    )
    for bad in (
        {"max_results": GREP_RESULTS_CEILING + 1},
        {"max_results": 0},
        {"offset": -1},
        {"context_before": MAX_GREP_CONTEXT_LINES + 1},
        {"context_after": -1},
        {"include": [""]},
    ):
        err = await failure(grep(machine, target, "x", **bad))  # type: ignore[arg-type]
        assert err.error_type == "bad_request", bad


async def test_line_length_boundary(machine: LocalMachine, root: Path) -> None:
    target = write(root / "w.txt", "a" * MAX_LINE_CHARS + "\n" + "b" * (MAX_LINE_CHARS + 1) + "\n")
    exact, long = (await grep(machine, target, "^[ab]")).matches
    assert exact.line_content == "a" * MAX_LINE_CHARS
    assert long.line_content == "b" * MAX_LINE_CHARS + LINE_TRUNCATED_MARKER


async def test_record_too_long_is_skipped_and_marks_truncated(machine: LocalMachine, root: Path) -> None:
    write(root / "r/a_huge.txt", "needle " + "x" * MAX_RECORD_BYTES + "\n")
    write(root / "r/b_small.txt", "needle\n")
    result = await grep(machine, str(root / "r"), "needle", max_file_size="20M")
    assert [os.path.basename(m.file) for m in result.matches] == ["b_small.txt"]
    assert result.truncated


async def test_crlf_lines_and_anchors(machine: LocalMachine, root: Path) -> None:
    target = write(root / "w.txt", b"one end\r\ntwo\r\n")
    (match,) = (await grep(machine, target, "end$", context_after=1)).matches
    assert (match.line_content, match.context_after) == ("one end", ["two"])


async def test_missing_path_is_not_found(machine: LocalMachine, root: Path) -> None:
    err = await failure(grep(machine, str(root / "nope"), "x"))
    assert (err.error_type, err.operation) == ("not_found", "grep")


# --- rg never outlives the call --------------------------------------------------------


@pytest.fixture
def slow_tree(root: Path) -> Path:
    """Enough matching lines that reading them all takes rg and the parser seconds."""
    base = root / "slow"
    write(base / "lines.txt", "hit\n" * 400_000)
    return base


async def test_timeout_kills_rg(machine: LocalMachine, slow_tree: Path) -> None:
    err = await failure(grep(machine, str(slow_tree), "hit", offset=10**9, max_file_size="10M", timeout=0.2))
    assert (err.error_type, err.errno_name) == ("io_error", "ETIMEDOUT")
    assert rg_pids_in(slow_tree) == []


async def test_cancel_kills_rg(machine: LocalMachine, slow_tree: Path) -> None:
    task = asyncio.ensure_future(grep(machine, str(slow_tree), "hit", offset=10**9, max_file_size="10M"))
    await wait_for(lambda: rg_pids_in(slow_tree) != [])
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert rg_pids_in(slow_tree) == []


# --- v1 search -------------------------------------------------------------------------


async def test_search_in_file_is_zero_based(machine: LocalMachine, root: Path) -> None:
    target = write(root / "app.py", APP)
    assert await search_in_file(machine, target, r"TODO|main\(\)") == (
        ["def main():", "    # TODO: read the input path from argv", "    main()"],
        [2, 3, 7],
    )
    assert await search_in_file(machine, target, "absent") == ([], [])
    err = await failure(search_in_file(machine, target, "("))
    assert (err.error_type, err.operation) == ("bad_request", "search")
    assert (await failure(search_in_file(machine, str(root), "x"))).error_type == "invalid_target"
    assert (await failure(search_in_file(machine, str(root / "nope"), "x"))).error_type == "not_found"


async def test_a_fifo_named_directly_is_refused_at_once(make_sandbox: SandboxFactory) -> None:
    """rg reading a FIFO would wait for a writer until the timeout: refused before rg starts."""
    from agentbox.machines.base import ExecRequest

    machine = await make_sandbox()
    await machine.exec(ExecRequest(command="mkfifo /workspace/fifo"))
    loop = asyncio.get_running_loop()
    started = loop.time()
    for search in (grep(machine, "/workspace/fifo", "x"), search_in_file(machine, "/workspace/fifo", "x")):
        refused = await failure(search)
        assert refused.error_type == "invalid_path", refused
    assert loop.time() - started < 5
