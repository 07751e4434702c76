"""The v2 file, command and sandbox routes over a real server, on each kind of machine
(`kind_server`: bubblewrap sandboxes, Docker containers, an ssh host).

Every test gets its own session (`/sandboxes/<id>`), so its `/tmp/demo` is its own. The
`Aio` helper is the seed's: `get` / `post` return the parsed `data` and raise on
`success: false`; `http` is the raw client for looking at failures.
"""

from __future__ import annotations

import base64
import io
import tarfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import Server, clear_scratch, on_kinds, start_server, stop_server

from agentbox.workspace.commands import MAX_INPUT_BYTES

APP_PY = (
    "import sys\n\n"
    "def main():\n"
    "    # TODO: read the input path from argv\n"
    "    print('hello')\n\n"
    "if __name__ == '__main__':\n"
    "    main()\n"
)
ERROR_FIELDS = [
    "errno",
    "errno_name",
    "error_type",
    "exception_type",
    "message",
    "operation",
    "path",
    "retryable",
]


class Failed(Exception):
    def __init__(self, reply: dict[str, Any]) -> None:
        super().__init__(reply.get("message"))
        self.reply = reply


#: The /tmp paths these tests make (cleared first where every session shares one /tmp).
SCRATCH = tuple(
    f"/tmp/{name}"
    for name in (
        "demo", "copy", "up", "owned", "watch-demo", "junk", "linked", "escape", "absolute", "escaped.txt",
        "absolute.txt", "nobodys", "nobodys-tree", "nobodys.txt", "a", "x",
    )
)  # fmt: skip


class Aio:
    """The seed's shared helper, bound to one session's sandbox."""

    def __init__(self, server: Server, session: str | None = None) -> None:
        prefix = f"/sandboxes/{session}" if session else ""
        headers = {"X-AIO-API-Key": server.api_key} if server.api_key else {}
        self.user = server.user
        """The machine's own user: one `?user=` may name."""
        self.root = server.root
        """The machine's root: where an upload with no path lands."""
        self.http = httpx.Client(base_url=server.url + prefix, headers=headers, timeout=60)

    @classmethod
    def fresh(cls, server: Server) -> Aio:
        return cls(server, f"t-{uuid.uuid4().hex[:12]}")

    def unwrap(self, response: httpx.Response) -> Any:
        reply = response.json()
        if not reply.get("success"):
            raise Failed(reply)
        return reply["data"]

    def get(self, route: str, /, **params: Any) -> Any:
        return self.unwrap(self.http.get(route, params=params))

    def post(self, route: str, /, **body: Any) -> Any:
        return self.unwrap(self.http.post(route, json=body))

    def delete(self, route: str) -> Any:
        return self.unwrap(self.http.delete(route))

    def run(self, command: str) -> dict[str, Any]:
        result = self.post("/v2/commands", command=command)
        assert result["exit_code"] == 0, result
        return result  # type: ignore[no-any-return]


@pytest.fixture
def sb(kind_server: Server) -> Iterator[Aio]:
    clear_scratch(kind_server, SCRATCH)
    aio = Aio.fresh(kind_server)
    yield aio
    aio.http.close()


def scaffold(sb: Aio) -> str:
    sb.post("/v2/fs/mkdir", path="/tmp/demo/src", parents=True)
    sb.post("/v2/fs/write", path="/tmp/demo/src/app.py", content=APP_PY)
    sb.post("/v2/fs/write", path="/tmp/demo/README.md", content="# demo\n")
    return "/tmp/demo/src/app.py"


def failure(response: httpx.Response, status: int, error_type: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    reply = response.json()
    assert reply["success"] is False and reply["hint"] is None
    assert list(reply["data"]) == ERROR_FIELDS
    assert reply["data"]["error_type"] == error_type
    assert reply["data"]["message"] == reply["message"]
    return reply  # type: ignore[no-any-return]


# ---------------------------------------------------------------- the seed, step by step


def test_seed_create_search_edit_read(sb: Aio) -> None:
    sb.post("/v2/fs/mkdir", path="/tmp/demo/src", parents=True)
    sb.post("/v2/fs/write", path="/tmp/demo/src/app.py", content=APP_PY)
    sb.post("/v2/fs/write", path="/tmp/demo/README.md", content="# demo\n")
    listed = sb.get("/v2/fs/list", path="/tmp/demo", recursive=True)
    assert [f["path"] for f in listed["files"]] == [
        "/tmp/demo/README.md",
        "/tmp/demo/src/app.py",
        "/tmp/demo/src",
    ]

    found = sb.get("/v2/fs/search", path="/tmp/demo", pattern="**/*.py")
    assert found["files"] == ["/tmp/demo/src/app.py"]
    target = found["files"][0]
    hit = sb.post("/v2/fs/grep", path=target, pattern="TODO.*")
    printed = [f"{m['line_number']} {m['line_content']}" for m in hit["matches"]]
    assert printed == ["4     # TODO: read the input path from argv"]

    edited = sb.post(
        "/v2/fs/edit",
        command="str_replace",
        path=target,
        old_str="    # TODO: read the input path from argv\n    print('hello')",
        new_str="    path = sys.argv[1]\n    print(open(path).read())",
    )
    assert edited["old_content"] == APP_PY
    assert edited["new_content"] == APP_PY.replace(
        "    # TODO: read the input path from argv\n    print('hello')",
        "    path = sys.argv[1]\n    print(open(path).read())",
    )
    assert "cat -n" in edited["output"] and "     4\t    path = sys.argv[1]" in edited["output"]

    result = sb.get("/v2/fs/read", path=target, start_line=2, end_line=5)
    assert result["content"] == "def main():\n    path = sys.argv[1]\n    print(open(path).read())\n"


def test_edit_keeps_only_three_commands(sb: Aio) -> None:
    target = scaffold(sb)
    for command, route in (("view", "GET /v2/fs/read"), ("create", "POST /v2/fs/write")):
        reply = failure(
            sb.http.post("/v2/fs/edit", json={"command": command, "path": target}), 400, "bad_request"
        )
        assert route in reply["message"]
    failure(sb.http.post("/v2/fs/edit", json={"command": "rewrite", "path": target}), 400, "bad_request")
    missing = sb.http.post(
        "/v2/fs/edit", json={"command": "str_replace", "path": target, "old_str": "nowhere", "new_str": "x"}
    )
    assert failure(missing, 400, "bad_request")["message"] == "old_str not found in file"
    no_old = sb.http.post("/v2/fs/edit", json={"command": "str_replace", "path": target, "new_str": "x"})
    assert "old_str" in failure(no_old, 400, "bad_request")["message"]

    inserted = sb.post("/v2/fs/edit", command="insert", path=target, insert_line=0, new_str="# header")
    assert inserted["new_content"] == "# header\n" + APP_PY
    undone = sb.post("/v2/fs/edit", command="undo_edit", path=target)
    assert undone["new_content"] == APP_PY
    assert sb.get("/v2/fs/read", path=target)["content"] == APP_PY


def test_grep_over_a_tree_with_context(sb: Aio) -> None:
    scaffold(sb)
    sb.post("/v2/fs/write", path="/tmp/demo/src/lib.py", content="a\nTODO one\nb\n")
    hit = sb.post("/v2/fs/grep", path="/tmp/demo", pattern="TODO", context_before=1, context_after=1)
    assert [(m["file"], m["line_number"]) for m in hit["matches"]] == [
        ("/tmp/demo/src/app.py", 4),
        ("/tmp/demo/src/lib.py", 2),
    ]
    assert hit["matches"][1]["context_before"] == ["a"] and hit["matches"][1]["context_after"] == ["b"]
    assert hit["matches"][0]["context_before"] == ["def main():"]


def test_search_is_globstar_aware_and_flat(sb: Aio) -> None:
    scaffold(sb)
    sb.post("/v2/fs/mkdir", path="/tmp/demo/src/deep/er", parents=True)
    sb.post("/v2/fs/write", path="/tmp/demo/src/deep/er/x.py", content="")
    assert sb.get("/v2/fs/search", path="/tmp/demo", pattern="*.py")["files"] == []
    assert sb.get("/v2/fs/search", path="/tmp/demo", pattern="**/*.py")["files"] == [
        "/tmp/demo/src/app.py",
        "/tmp/demo/src/deep/er/x.py",
    ]


# ---------------------------------------------------------------- transfer


def test_download_whole_and_ranges(sb: Aio) -> None:
    target = scaffold(sb)
    whole = sb.http.get("/v2/fs/download", params={"path": target})
    assert whole.status_code == 200 and whole.content == APP_PY.encode()
    assert whole.headers["accept-ranges"] == "bytes" and whole.headers["content-length"] == str(len(APP_PY))

    part = sb.http.get("/v2/fs/download", params={"path": target}, headers={"Range": "bytes=0-9"})
    assert part.status_code == 206 and part.content == APP_PY.encode()[:10]
    assert part.headers["content-range"] == f"bytes 0-9/{len(APP_PY)}"
    tail = sb.http.get("/v2/fs/download", params={"path": target}, headers={"Range": "bytes=-5"})
    assert tail.status_code == 206 and tail.content == APP_PY.encode()[-5:]
    last = sb.http.get(
        "/v2/fs/download", params={"path": target}, headers={"Range": f"bytes={len(APP_PY) - 1}-"}
    )
    assert last.status_code == 206 and last.content == b"\n"

    beyond = sb.http.get(
        "/v2/fs/download", params={"path": target}, headers={"Range": f"bytes={len(APP_PY)}-"}
    )
    assert beyond.status_code == 416 and beyond.headers["content-range"] == f"bytes */{len(APP_PY)}"
    assert beyond.json()["success"] is False
    failure(sb.http.get("/v2/fs/download", params={"path": "/tmp/demo/nope"}), 404, "not_found")
    failure(sb.http.get("/v2/fs/download", params={"path": "/tmp/demo/src"}), 400, "invalid_target")
    failure(sb.http.get("/v2/fs/download", params={"path": target, "user": "root"}), 400, "bad_request")


def test_upload_is_staged_and_renamed(sb: Aio) -> None:
    sb.post("/v2/fs/mkdir", path="/tmp/demo", parents=True)
    sb.post("/v2/fs/write", path="/tmp/demo/data.csv", content="old\n")
    before = sb.run("stat -c %i /tmp/demo/data.csv")["stdout"]
    response = sb.http.post(
        "/v2/fs/upload", files={"file": ("data.csv", b"a,b\n1,2\n")}, data={"path": "/tmp/demo/data.csv"}
    )
    data = sb.unwrap(response)
    assert data["file_path"] == "/tmp/demo/data.csv" and data["file_size"] == 8
    assert sb.get("/v2/fs/read", path="/tmp/demo/data.csv")["content"] == "a,b\n1,2\n"
    assert sb.run("stat -c %i /tmp/demo/data.csv")["stdout"] != before  # renamed over, not rewritten
    assert sb.run("ls -a /tmp/demo")["stdout"].split() == [".", "..", "data.csv"]  # no .part left

    unnamed = sb.unwrap(sb.http.post("/v2/fs/upload", files={"file": ("note.txt", b"hi")}))
    assert unnamed["file_path"] == f"{sb.root}/note.txt"
    missing = sb.http.post("/v2/fs/upload", data={"path": "/tmp/demo/x"})
    assert missing.status_code == 422 and missing.json()["errors"][0]["location"] == ["body", "file"]
    failure(
        sb.http.post("/v2/fs/upload", files={"file": ("x", b"x")}, data={"path": "/tmp/nodir/x"}),
        404,
        "not_found",
    )


def test_tree_round_trip_and_evil_archives(sb: Aio) -> None:
    scaffold(sb)
    got = sb.http.get("/v2/fs/tree", params={"path": "/tmp/demo"})
    assert got.status_code == 200 and got.headers["content-type"] == "application/x-tar"
    with tarfile.open(fileobj=io.BytesIO(got.content)) as tar:
        assert sorted(tar.getnames()) == ["README.md", "src", "src/app.py"]
    put = sb.unwrap(sb.http.put("/v2/fs/tree", params={"path": "/tmp/copy"}, content=got.content))
    assert put["path"] == "/tmp/copy" and put["files_written"] == 2
    assert sb.get("/v2/fs/read", path="/tmp/copy/src/app.py")["content"] == APP_PY
    assert sb.get("/v2/fs/read", path="/tmp/copy/README.md")["content"] == "# demo\n"

    for name, member in (("escape", "../escaped.txt"), ("absolute", "/tmp/absolute.txt")):
        reply = failure(
            sb.http.put("/v2/fs/tree", params={"path": f"/tmp/{name}"}, content=evil_tar(member)),
            400,
            "invalid_path",
        )
        assert member in reply["message"]
    link = sb.http.put("/v2/fs/tree", params={"path": "/tmp/linked"}, content=evil_tar("ok.txt", link="/etc"))
    failure(link, 400, "invalid_path")
    listing = sb.run("ls -a /tmp")["stdout"].split()
    assert not {"escape", "absolute", "linked", "escaped.txt", "absolute.txt"} & set(listing)
    failure(
        sb.http.put("/v2/fs/tree", params={"path": "/tmp/junk"}, content=b"not a tar"), 400, "bad_request"
    )
    failure(sb.http.get("/v2/fs/tree", params={"path": "/tmp/demo", "user": "root"}), 400, "bad_request")


def evil_tar(name: str, link: str | None = None) -> bytes:
    """A tar with one harmless file and then `name` (escaping, absolute, or a symlink out)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for member_name, data in (("fine.txt", b"fine"), (name, b"evil")):
            info = tarfile.TarInfo(member_name)
            if link is not None and member_name == name:
                info.type, info.linkname = tarfile.SYMTYPE, link
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


# ---------------------------------------------------------------- write, owners


@on_kinds("sandbox", "docker")  # through the protocol every write is an atomic rename (remote_files.py)
def test_write_in_place_keeps_the_inode_and_user_stages(sb: Aio) -> None:
    sb.post("/v2/fs/mkdir", path="/tmp/demo", parents=True)
    sb.post("/v2/fs/write", path="/tmp/demo/f.txt", content="one\n")
    inode = sb.run("stat -c %i /tmp/demo/f.txt")["stdout"]
    sb.post("/v2/fs/write", path="/tmp/demo/f.txt", content="two\n")
    assert sb.run("stat -c %i /tmp/demo/f.txt")["stdout"] == inode
    sb.post("/v2/fs/write", path="/tmp/demo/f.txt", content="three\n", append=True)
    assert sb.get("/v2/fs/read", path="/tmp/demo/f.txt")["content"] == "two\nthree\n"

    sb.unwrap(
        sb.http.post(
            "/v2/fs/write", params={"user": sb.user}, json={"path": "/tmp/demo/f.txt", "content": "x"}
        )
    )
    assert sb.run("stat -c %i /tmp/demo/f.txt")["stdout"] != inode
    assert sb.run("stat -c %U /tmp/demo/f.txt")["stdout"] == f"{sb.user}\n"
    assert sb.run("ls -a /tmp/demo")["stdout"].split() == [".", "..", "f.txt"]

    encoded = base64.b64encode(b"\x00\x01binary").decode()
    sb.post("/v2/fs/write", path="/tmp/demo/b.bin", content=encoded, encoding="base64")
    assert sb.http.get("/v2/fs/download", params={"path": "/tmp/demo/b.bin"}).content == b"\x00\x01binary"


#: A user name no machine of these tests has.
NO_SUCH_USER = "no-such-user-7f3a"


def test_user_query_owner(sb: Aio) -> None:
    made = sb.unwrap(sb.http.post("/v2/fs/mkdir", params={"user": sb.user}, json={"path": "/tmp/owned"}))
    assert made == {"path": "/tmp/owned", "created": True}
    assert sb.run("stat -c %U /tmp/owned")["stdout"] == f"{sb.user}\n"
    for method, route, path, body in (
        ("POST", "/v2/fs/mkdir", None, {"path": "/tmp/nobodys"}),
        ("POST", "/v2/fs/write", None, {"path": "/tmp/nobodys.txt", "content": "x"}),
        ("GET", "/v2/fs/read", "/tmp/owned", None),
        ("PUT", "/v2/fs/tree", "/tmp/nobodys-tree", None),
    ):
        params = {"user": NO_SUCH_USER, **({"path": path} if path else {})}
        content = evil_tar("a.txt") if method == "PUT" else None
        response = sb.http.request(method, route, params=params, json=body, content=content)
        assert (
            f"cannot give files to user {NO_SUCH_USER!r}" in failure(response, 400, "bad_request")["message"]
        )
    assert "nobodys" not in sb.run("ls /tmp")["stdout"]


# ---------------------------------------------------------------- errors


def test_error_envelope_table(sb: Aio) -> None:
    sb.post("/v2/fs/mkdir", path="/tmp/demo/src", parents=True)
    missing = sb.http.get("/v2/fs/read", params={"path": "/tmp/demo/missing.txt"})
    assert failure(missing, 404, "not_found") == {
        "success": False,
        "message": "Failed to read file: No such file or directory (os error 2)",
        "data": {
            "errno": 2,
            "errno_name": "ENOENT",
            "error_type": "not_found",
            "exception_type": "FileNotFoundError",
            "message": "Failed to read file: No such file or directory (os error 2)",
            "operation": "read",
            "path": "/tmp/demo/missing.txt",
            "retryable": False,
        },
        "hint": None,
        "request_id": missing.headers["x-request-id"],  # the id the logs name this request by
    }
    exists = failure(sb.http.post("/v2/fs/mkdir", json={"path": "/tmp/demo/src"}), 409, "already_exists")
    assert exists["data"]["errno_name"] == "EEXIST"
    failure(sb.http.get("/v2/fs/read", params={"path": "/tmp/demo/src"}), 400, "invalid_target")
    failure(sb.http.get("/v2/fs/read", params={"path": "/tmp/a\x00b"}), 400, "invalid_path")
    bad64 = sb.http.post("/v2/fs/write", json={"path": "/tmp/demo/x", "content": "%%%", "encoding": "base64"})
    failure(bad64, 422, "decode_error")
    not_ascii = sb.http.post(
        "/v2/fs/write", json={"path": "/tmp/demo/x", "content": "é", "encoding": "base64"}
    )
    failure(not_ascii, 422, "decode_error")
    sb.post(
        "/v2/fs/write",
        path="/tmp/demo/latin1.txt",
        content=base64.b64encode(b"caf\xe9").decode(),
        encoding="base64",
    )
    failure(sb.http.get("/v2/fs/read", params={"path": "/tmp/demo/latin1.txt"}), 422, "decode_error")
    failure(
        sb.http.get("/v2/fs/read", params={"path": "/tmp/demo/src/app.py", "start_line": -1}),
        400,
        "bad_request",
    )


@on_kinds("sandbox", "docker")  # an ssh host's /proc and /usr are the host's, under its own rights
def test_the_machine_boundary_in_the_envelope(sb: Aio) -> None:
    failure(sb.http.get("/v2/fs/read", params={"path": "/proc/self/environ"}), 400, "invalid_path")
    denied = sb.http.post("/v2/fs/write", json={"path": "/usr/evil", "content": "x"})
    assert denied.status_code == 403 and denied.json()["data"]["errno_name"] == "EROFS"


@pytest.mark.parametrize(
    ("body", "location"),
    [
        (b'{"path":', ["body"]),
        (b"[1, 2]", ["body"]),
        (b"", ["body", "path"]),
        (b'{"parents": true}', ["body", "path"]),
        (b'{"path": 5}', ["body", "path"]),
        (b'{"path": "/tmp/x", "parents": "very"}', ["body", "parents"]),
        (b'{"path": "\\ud800"}', ["body"]),
        (b"[" * 100_000, ["body"]),
    ],
    ids=["truncated", "array", "empty", "missing", "mistyped", "bad-bool", "surrogate", "deep"],
)
def test_malformed_json_body_is_422_with_locations(sb: Aio, body: bytes, location: list[str]) -> None:
    response = sb.http.post("/v2/fs/mkdir", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 422, response.text
    reply = response.json()
    assert reply["success"] is False and reply["errors"][0]["location"] == location


@pytest.mark.parametrize(
    ("route", "params"),
    [
        ("/v2/fs/read", {}),
        ("/v2/fs/read", {"path": "/tmp", "start_line": "two"}),
        ("/v2/fs/list", {"path": "/tmp", "recursive": "maybe"}),
        ("/v2/fs/search", {"path": "/tmp"}),
        ("/v2/fs/download", {}),
    ],
)
def test_malformed_query_is_400_plain_text(sb: Aio, route: str, params: dict[str, str]) -> None:
    response = sb.http.get(route, params=params)
    assert response.status_code == 400
    assert response.headers["content-type"].startswith("text/plain")
    assert response.text.startswith("Invalid request parameters")


# ---------------------------------------------------------------- commands


def test_sync_commands_report_their_own_outcome(sb: Aio) -> None:
    done = sb.post("/v2/commands", command="echo out; echo err >&2; exit 3")
    assert (done["exit_code"], done["stdout"], done["stderr"], done["status"]) == (
        3,
        "out\n",
        "err\n",
        "completed",
    )
    env = sb.post("/v2/commands", command="echo $GREETING; pwd", env={"GREETING": "hi"}, cwd="/tmp")
    assert env["stdout"] == "hi\n/tmp\n"
    slow = sb.http.post("/v2/commands", json={"command": "sleep 10", "timeout": 0.5})
    assert slow.status_code == 200 and slow.json()["success"] is True
    assert slow.json()["data"]["status"] == "timed_out"
    failure(sb.http.post("/v2/commands", json={"command": "true", "cwd": "/tmp/nowhere"}), 404, "not_found")
    failure(sb.http.post("/v2/commands", json={"command": "  "}), 400, "bad_request")
    failure(sb.http.post("/v2/commands", json={"command": "true", "timeout": 0}), 400, "bad_request")
    bad_mode = sb.http.post("/v2/commands", json={"command": "true", "mode": "later"})
    assert bad_mode.status_code == 422 and bad_mode.json()["errors"][0]["location"] == ["body", "mode"]


def test_a_command_reads_the_input_it_was_given(sb: Aio) -> None:
    assert sb.post("/v2/commands", command="tr a-z A-Z", stdin="shout\n")["stdout"] == "SHOUT\n"
    assert sb.post("/v2/commands", command="wc -c", stdin="x" * MAX_INPUT_BYTES)["stdout"].strip() == str(
        MAX_INPUT_BYTES
    )
    assert sb.post("/v2/commands", command="true", stdin="never read")["exit_code"] == 0  # not an error
    started = sb.post("/v2/commands", command="cat", stdin="later\n", mode="async")
    ended = sb.get(f"/v2/commands/{started['command_id']}", wait=30)
    assert (ended["status"], ended["stdout"]) == ("completed", "later\n")  # its stdin was closed after
    over = sb.http.post("/v2/commands", json={"command": "cat", "stdin": "x" * (MAX_INPUT_BYTES + 1)})
    assert failure(over, 400, "bad_request")["data"]["errno_name"] == "EFBIG"


def test_async_command_output_so_far_then_kill(sb: Aio) -> None:
    started = sb.post("/v2/commands", mode="async", command="echo first; sleep 60")
    command_id = started["command_id"]
    assert started["status"] == "running" and command_id.startswith("cmd_")
    seen = sb.get(f"/v2/commands/{command_id}", wait=0)
    for _ in range(100):
        if seen["stdout"]:
            break
        seen = sb.get(f"/v2/commands/{command_id}", wait=0.05)  # returns early only when it ends
    assert seen["stdout"] == "first\n" and seen["status"] == "running"
    assert command_id in [c["command_id"] for c in sb.get("/v2/commands")["commands"]]
    killed = sb.delete(f"/v2/commands/{command_id}")
    assert killed["status"] == "killed" and killed["exit_code"] == 137
    failure(sb.http.get("/v2/commands/cmd_nope"), 404, "not_found")
    failure(sb.http.delete("/v2/commands/cmd_nope"), 404, "not_found")

    quick = sb.post("/v2/commands", mode="async", command="echo done")
    ended = sb.get(f"/v2/commands/{quick['command_id']}", wait=10)
    assert (ended["status"], ended["exit_code"], ended["stdout"]) == ("completed", 0, "done\n")


# ---------------------------------------------------------------- sandbox, capabilities, auth


@on_kinds("sandbox")  # what it asserts names bubblewrap; each kind's own report is its tests'
def test_sandbox_and_capabilities(sb: Aio, server: Server) -> None:
    info = sb.get("/v2/sandbox")
    assert {"files", "watch", "commands"} <= set(info["capabilities"])
    assert info["session_id"].startswith("t-")
    assert info["machine"]["kind"] == "sandbox" and info["machine"]["root"] == "/workspace"
    assert info["isolation"]["isolation"] == "bubblewrap"
    with server.client() as client:
        caps = client.get("/v1/capabilities").json()
    assert "files" in caps["data"]["capabilities"] and "files" in caps["capabilities"]


def test_api_key_three_ways(sandbox_tmp: Path) -> None:
    home = sandbox_tmp / "home"
    home.mkdir()
    secured = start_server(home, env={"AGENTBOX_API_KEY": "s3cret"})
    try:
        url = secured.url + "/v1/capabilities"
        assert httpx.get(secured.url + "/health").status_code == 200
        denied = httpx.get(url)
        assert denied.status_code == 401 and denied.json()["success"] is False
        assert httpx.get(url, headers={"X-AIO-API-Key": "wrong"}).status_code == 401
        assert httpx.get(url, headers={"X-AIO-API-Key": "s3cret"}).status_code == 200
        assert httpx.get(url, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(url, params={"api_key": "s3cret"}).status_code == 200
    finally:
        stop_server(secured)
