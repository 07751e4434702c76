"""Schemathesis (4.x API) over our own OpenAPI document: no generated request gets a 5xx,
and every reply fits the schema the document gives for its status and media type.

The schema is loaded from a real `agentbox serve` (the session's `server` fixture, real
bubblewrap sandboxes) and every operation at the root gets its own test: hypothesis draws
positive cases (fitting the schema) and negative ones (breaking it), and each must be
answered below 500 (`not_a_server_error`) within REQUEST_TIMEOUT_SECONDS, with a body that
conforms to the document (`response_schema_conformance`: JSON bodies, each event of an SSE
stream). A request that does not answer in time fails like a 5xx does: a hang is a bug too.

What is left out, and why:
- `/sandboxes/{session_id}/...`: the same routers as the root ones (`app.py` includes each
  twice), and every valid generated id would start a new sandbox.
Nothing else is. No route kills the server: the DELETE routes only end watchers, commands
and shell sessions of the default sandbox, and whatever a generated path or command does
stays inside that sandbox (no other test uses the default session). The SSE routes are
fuzzed too (see below), and so is `/v1/sessions`, with generated ids only.

Random input alone rarely gets past the first lookup (an unknown id is a 404, a random
`user` a 400, a random editor command a 400), so for half of the cases the test steers
(`steer`): ids become those of a live watcher, command or shell session, paths one of
KNOWN_PATHS (files, a directory, a symlink, a fifo, read-only and system paths), `user`
one the sandbox knows, editor commands real ones, and `PUT /v2/fs/tree` gets a real tar of
generated members (`tar_archives`). The rest of the case stays as generated.

Bounded so the file runs in well under two minutes:
- long-poll times are capped at LONG_POLL_CAP_SECONDS (`cap_waits`): a live watcher with
  nothing happening would otherwise hold a poll for up to 300 s.
- the SSE routes are read up to their first event (schemathesis cuts an event stream after
  `max-stream-events`), which fuzzes their validation without streaming forever.
- watchers and shell sessions a case made are removed after it (`Live.reset`), so the
  per-sandbox limits (64 of each) do not turn later cases into the same 400.
"""

from __future__ import annotations

import io
import json
import math
import os
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
from conftest import Server
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import Case, GenerationMode
from schemathesis.checks import not_a_server_error, response_schema_conformance
from schemathesis.core.result import Ok
from schemathesis.schemas import APIOperation, BaseSchema

from agentbox.api.app import create_app
from agentbox.api.v2_watch import MAX_SEQ_DIGITS
from agentbox.config import Settings
from agentbox.workspace.files import MAX_RANGE_DIGITS

#: Cases hypothesis tries per operation (positive and negative together); AGENTBOX_FUZZ_EXAMPLES
#: raises it for a deeper run by hand (the default keeps the file well under two minutes).
MAX_EXAMPLES = int(os.environ.get("AGENTBOX_FUZZ_EXAMPLES", "30"))
#: Seconds one request may take before the case fails as a hang.
REQUEST_TIMEOUT_SECONDS = 30.0
#: Longest long-poll (`timeout`, `wait`, `seconds`, ...) a case may ask for, in seconds.
LONG_POLL_CAP_SECONDS = 0.2
#: Events read from an SSE response before it is cut (the first is `watch_started`).
MAX_STREAM_EVENTS = 1
#: Members of a generated tar archive, at most.
MAX_TAR_MEMBERS = 5
#: The only prefix not fuzzed (see the module docstring), as it begins a path in a label
#: (`GET /sandboxes/...`; `/v1/sandboxes/{session_id}` is fuzzed).
SESSION_PREFIX = " /sandboxes/"

#: Where the steered cases' files live; live watchers watch it, so fuzzed writes there are events.
KNOWN_DIR = "/workspace/fuzz-known"
#: Made once by a command inside the sandbox (as its own user).
MAKE_KNOWN = (
    f"mkdir -p {KNOWN_DIR}/sub && cd {KNOWN_DIR} && printf 'one\\ntwo\\nthree\\n' > notes.txt"
    " && printf '\\377\\376\\000bin' > data.bin && ln -sf notes.txt link && ln -sf /etc/passwd out"
    " && ln -sf missing dangling && { [ -p fifo ] || mkfifo fifo; }"
)
#: Paths a steered case uses: each kind of thing a path can name, relative ones included.
KNOWN_PATHS = (
    KNOWN_DIR,
    f"{KNOWN_DIR}/notes.txt",
    "fuzz-known/notes.txt",
    f"{KNOWN_DIR}/data.bin",
    f"{KNOWN_DIR}/sub",
    f"{KNOWN_DIR}/link",
    f"{KNOWN_DIR}/out",
    f"{KNOWN_DIR}/dangling",
    f"{KNOWN_DIR}/fifo",
    f"{KNOWN_DIR}/new-file",
    f"{KNOWN_DIR}/sub/../notes.txt",
    "/tmp",
    "/etc/passwd",
    "/etc",
)
#: Fields (query or body) that name a path.
PATH_FIELDS = ("path", "file", "exec_dir", "cwd")
#: `?user=` values the sandbox knows; None drops the parameter.
KNOWN_USERS = (None, "root", "0")
#: Editor commands, for the routes whose `command` is one (elsewhere it is a shell command).
EDITOR_COMMANDS = ("view", "create", "str_replace", "insert", "undo_edit")
EDITOR_ROUTES = ("/v2/fs/edit", "/v1/file/str_replace_editor")
#: Path parameters that name something live, and body fields that name a shell session.
LIVE_PATH_PARAMETERS = ("watcher_id", "command_id", "shell_session_id", "bash_session_id")
SESSION_BODY_FIELDS = {"/v1/shell/": "id", "/v1/bash/": "session_id"}

#: Headers some routes read that the document does not list (or lists as plain text).
RANGE_ROUTES = ("/v2/fs/download", "/v1/file/download")
RESUME_ROUTES = ("/v2/watch/{watcher_id}/events", "/v1/file/watch/{watcher_id}/events")
#: Digits past what `int()` reads from text (4300 by default): a number no parser should choke on.
HUGE_DIGITS = "1" * 5000
#: `Range` values tried besides generated text: one byte, a suffix, open-ended, reversed, two
#: ranges, another unit, an empty suffix, no numbers, past any file, too long to parse, a digit
#: that is not ASCII (latin-1 has three).
RANGE_DICTIONARY = (
    "bytes=0-0",
    "bytes=-1",
    "bytes=0-",
    "bytes=5-1",
    "bytes=0-1,3-4",
    "items=0-1",
    "bytes=-0",
    "bytes=-",
    "bytes=" + "9" * 30 + "-",
    f"bytes={HUGE_DIGITS}-",
    f"bytes=-{HUGE_DIGITS}",
    f"bytes=0-{HUGE_DIGITS}",
    "bytes=\u00b2-",
)
#: Sequence numbers after `<watcher_id>:` in `Last-Event-ID`, besides generated text.
SEQ_DICTIONARY = ("0", "1", "-1", "99999999999999999999", HUGE_DIGITS, "\u00b2", "")

#: Long-poll fields, by operation label: (where, name) with where "query" or "body".
LONG_POLLS: dict[str, tuple[tuple[str, str], ...]] = {
    "GET /v2/watch/{watcher_id}/poll": (("query", "timeout"),),
    "GET /v2/commands/{command_id}": (("query", "wait"),),
    "POST /v1/file/watch/{watcher_id}/poll": (("body", "timeout"),),
    "POST /v1/file/watch/wait": (("body", "timeout"),),
    "POST /v1/shell/wait": (("body", "seconds"), ("body", "max_wait_seconds")),
    "POST /v1/bash/output": (("body", "wait_timeout"),),
}
#: Long-poll fields whose absence (or null) means a long wait (`watch/wait`: 30 s on any path).
LONG_POLL_DEFAULTS: dict[str, tuple[str, str]] = {"POST /v1/file/watch/wait": ("body", "timeout")}
#: Route prefixes whose cases leave watchers or shell sessions behind.
STATEFUL_PREFIXES = ("/v1/shell/", "/v1/bash/", "/v2/watch", "/v1/file/watch")
#: The one documented 5xx: `watch/wait` answers 503 when nothing happened in time (upstream AIO).
WAIT_TIMEOUT_LABEL = "POST /v1/file/watch/wait"
#: Routes that need a browser (the fuzzed server's machine has none) and answer failures with
#: their HTTP status rather than v1's 200: the screenshots (the SDK reads a 200 as the image) and CDP.
BROWSER_STATUS_ROUTES = ("/v1/browser/screenshot", "/v1/browser/page/screenshot", "/cdp/")
TREE_PUT_LABEL = "PUT /v2/fs/tree"


def documented_operations() -> list[str]:
    """Labels of the root operations, from the app itself (the served document is checked below)."""
    app = create_app(Settings(home=Path("/nonexistent/agentbox-openapi-fuzz")))
    paths: dict[str, dict[str, Any]] = app.openapi()["paths"]
    return [f"{method.upper()} {path}" for path, ops in paths.items() for method in ops]


# `PUT /v2/fs/tree` takes a tar body; schemathesis sends its generated bytes as they are.
schemathesis.serializer.alias("application/x-tar", "application/octet-stream")

OPERATIONS = [label for label in documented_operations() if SESSION_PREFIX not in label]


# ---------------------------------------------------------------- live state


@dataclass
class Live:
    """Real ids and files for steered cases, made in the default sandbox."""

    url: str
    http: requests.Session

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        response = self.http.request(method, self.url + path, json=body, timeout=REQUEST_TIMEOUT_SECONDS)
        assert response.status_code == 200, f"{method} {path}: {response.status_code} {response.text}"
        reply: dict[str, Any] = response.json()
        assert reply["success"], reply
        return reply

    def make_known(self) -> None:
        result = self.call("POST", "/v2/commands", {"command": MAKE_KNOWN})["data"]
        assert result["exit_code"] == 0, result

    def watcher(self) -> str:
        return str(self.call("POST", "/v2/watch", {"path": KNOWN_DIR})["watcher_id"])

    def command(self) -> str:
        return str(self.call("POST", "/v2/commands", {"command": "echo fuzz"})["data"]["command_id"])

    def session(self) -> str:
        return str(self.call("POST", "/v1/shell/sessions/create", {})["data"]["session_id"])

    def id_for(self, parameter: str) -> str:
        if parameter == "watcher_id":
            return self.watcher()
        if parameter == "command_id":
            return self.command()
        return self.session()

    def reset(self) -> None:
        """Remove every watcher and shell session of the default sandbox."""
        self.call("DELETE", "/v1/shell/sessions")
        for watcher in self.call("GET", "/v2/watch")["data"]["watchers"]:
            self.call("DELETE", f"/v2/watch/{watcher['watcher_id']}")


# ---------------------------------------------------------------- shaping cases


def holder(case: Case, where: str) -> dict[str, Any] | None:
    """The case's query or JSON body as a dict, when it is one."""
    value = case.query if where == "query" else case.body
    return value if isinstance(value, dict) else None


def steer(case: Case, live: Live, data: st.DataObject) -> None:
    """Swap the case's random ids, paths, user and editor command for ones that exist."""
    path = case.operation.path
    for name in LIVE_PATH_PARAMETERS:
        if case.path_parameters and name in case.path_parameters:
            case.path_parameters[name] = live.id_for(name)
    for prefix, name in SESSION_BODY_FIELDS.items():
        body = holder(case, "body")
        if path.startswith(prefix) and body is not None and name in body:
            body[name] = live.session()
    for where in ("query", "body"):
        fields = holder(case, where)
        if fields is None:
            continue
        for name in PATH_FIELDS:
            if name in fields:
                fields[name] = data.draw(st.sampled_from(KNOWN_PATHS), label=f"{where}.{name}")
        if "user" in fields:
            user = data.draw(st.sampled_from(KNOWN_USERS), label=f"{where}.user")
            if user is None:
                del fields["user"]
            else:
                fields["user"] = user
        if path in EDITOR_ROUTES and "command" in fields:
            fields["command"] = data.draw(st.sampled_from(EDITOR_COMMANDS), label="editor command")
    if case.operation.label == TREE_PUT_LABEL:
        case.body = data.draw(tar_archives(), label="tar")
        case.media_type = "application/x-tar"
    if path in RANGE_ROUTES:
        value = data.draw(st.one_of(st.sampled_from(RANGE_DICTIONARY), header_text()), label="Range")
        set_header(case, "Range", value)
    if path in RESUME_ROUTES and case.path_parameters:
        seq = data.draw(st.one_of(st.sampled_from(SEQ_DICTIONARY), header_text()), label="seq")
        set_header(case, "last-event-id", f"{case.path_parameters['watcher_id']}:{seq}")


def header_text() -> st.SearchStrategy[str]:
    """Text an HTTP client can send as a header value: latin-1, no controls, no edge whitespace."""
    chars = st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f")
    return st.text(chars, max_size=30).map(str.strip)


def set_header(case: Case, name: str, value: str) -> None:
    """Set a header, replacing one the case has under any spelling of its name."""
    case.headers[name] = value  # a case-insensitive dict


def cap_waits(case: Case) -> None:
    """Cap the case's long-poll times at LONG_POLL_CAP_SECONDS (and give one where absence waits long)."""
    label = case.operation.label
    for where, name in LONG_POLLS.get(label, ()):
        fields = holder(case, where)
        if fields is not None and name in fields and exceeds_cap(fields[name]):
            fields[name] = LONG_POLL_CAP_SECONDS
    if label in LONG_POLL_DEFAULTS:
        where, name = LONG_POLL_DEFAULTS[label]
        fields = holder(case, where)
        if fields is not None and fields.get(name) is None:  # null is the default too
            fields[name] = LONG_POLL_CAP_SECONDS


def exceeds_cap(value: Any) -> bool:
    """Whether the server would read `value` as a wait longer than the cap (query values are text)."""
    if isinstance(value, bool):
        return False
    try:
        seconds = float(value)
    except (TypeError, ValueError, OverflowError):
        return False
    return not math.isnan(seconds) and seconds > LONG_POLL_CAP_SECONDS


MEMBER_TYPES = (
    tarfile.REGTYPE,
    tarfile.DIRTYPE,
    tarfile.SYMTYPE,
    tarfile.LNKTYPE,
    tarfile.FIFOTYPE,
    tarfile.CHRTYPE,
)
#: Member names a real archive (or an attack) has, besides generated text.
MEMBER_NAMES = ("a", "a/b", "./a", "a/", "../x", "/abs", "sub", "notes.txt", "link", ".")


@st.composite
def tar_members(draw: st.DrawFn) -> tuple[tarfile.TarInfo, bytes]:
    text = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=20)
    info = tarfile.TarInfo(draw(st.one_of(st.sampled_from(MEMBER_NAMES), text)))
    info.type = draw(st.sampled_from(MEMBER_TYPES))
    info.mode = draw(st.integers(0, 0o7777))
    info.linkname = draw(st.one_of(st.sampled_from(MEMBER_NAMES), text))
    content = draw(st.binary(max_size=64)) if info.type == tarfile.REGTYPE else b""
    info.size = len(content)
    return info, content


@st.composite
def tar_archives(draw: st.DrawFn) -> bytes:
    """A tar of generated members (names, types, links and modes), read by `tarfile` as valid."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for info, content in draw(st.lists(tar_members(), min_size=1, max_size=MAX_TAR_MEMBERS)):
            archive.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


# ---------------------------------------------------------------- the fuzzing


@dataclass
class Fuzz:
    schema: BaseSchema
    live: Live


@pytest.fixture(scope="module")
def fuzz(server: Server) -> Iterator[Fuzz]:
    config = schemathesis.Config.from_dict({"max-stream-events": MAX_STREAM_EVENTS})
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json", config=config)
    with requests.Session() as http:
        live = Live(server.url, http)
        live.make_known()
        yield Fuzz(schema, live)
        live.reset()


def has_inputs(operation: APIOperation) -> bool:
    """Whether a negative case can exist: the operation takes parameters or a body."""
    raw = operation.definition.raw
    return bool(raw.get("parameters") or raw.get("requestBody"))


def cases(operation: APIOperation) -> st.SearchStrategy[Case]:
    modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if has_inputs(operation) else [])
    return st.one_of(*(operation.as_strategy(mode) for mode in modes))


def documented_server_error(case: Case, response: schemathesis.Response) -> bool:
    """The 5xx the API documents: `watch/wait` timing out (503, errno ETIMEDOUT), and a route
    that needs the browser and answers with its HTTP status on this server, whose machine has
    none (503 `browser_unavailable`)."""
    if response.status_code != 503:
        return False
    data = json.loads(response.content).get("data") or {}
    if case.operation.path.startswith(BROWSER_STATUS_ROUTES):
        return bool(data.get("error_type") == "browser_unavailable")
    return case.operation.label == WAIT_TIMEOUT_LABEL and data.get("errno_name") == "ETIMEDOUT"


def test_every_served_operation_is_fuzzed(fuzz: Fuzz) -> None:
    """The parametrisation comes from the app; the served document must have the same operations."""
    served = []
    for result in fuzz.schema.get_all_operations():
        assert isinstance(result, Ok), result
        served.append(result.ok().label)
    assert sorted(label for label in served if SESSION_PREFIX not in label) == sorted(OPERATIONS)
    assert len(OPERATIONS) > 50


def test_long_poll_cap_boundary() -> None:
    """Exactly the cap is left alone; anything longer, in any spelling the server reads, is capped."""
    assert not exceeds_cap(LONG_POLL_CAP_SECONDS)
    assert not exceeds_cap(str(LONG_POLL_CAP_SECONDS))
    assert exceeds_cap(math.nextafter(LONG_POLL_CAP_SECONDS, math.inf))
    assert all(exceeds_cap(value) for value in ("1e3", 10**9, "inf"))
    assert not any(exceeds_cap(value) for value in (True, "nan", "soon", None))


# ---------------------------------------------------------------- what the fuzzing found


@pytest.mark.parametrize("route", RANGE_ROUTES)
def test_range_positions_longer_than_int_reads(route: str, fuzz: Fuzz) -> None:
    """Found by this file: a `Range` position of 5000 digits was a 500 (`int()` refuses it).

    Up to MAX_RANGE_DIGITS digits a position is read as written; past it, it is past the end.
    """
    path, content = "/workspace/range-check.txt", "one\ntwo\nthree\n"  # outside KNOWN_DIR: cases leave it be
    fuzz.live.call("POST", "/v2/fs/write", {"path": path, "content": content})
    at_limit, over = "9" * MAX_RANGE_DIGITS, "1" + "0" * MAX_RANGE_DIGITS
    expected = {
        f"bytes={at_limit}-": 416,
        f"bytes={over}-": 416,
        f"bytes={HUGE_DIGITS}-": 416,
        f"bytes=0-{HUGE_DIGITS}": 206,
        f"bytes=-{HUGE_DIGITS}": 206,
        f"bytes=0{'0' * MAX_RANGE_DIGITS}1-": 206,  # leading zeros do not count
    }
    for value, status in expected.items():
        response = fuzz.live.http.get(
            fuzz.live.url + route,
            params={"path": path},
            headers={"Range": value},
            timeout=REQUEST_TIMEOUT_SECONDS,
        )
        assert response.status_code == status, (value[:40], response.text)
        if status == 206:
            assert response.content == content.encode()[-len(response.content) :]


@pytest.mark.parametrize("route", RESUME_ROUTES)
def test_last_event_id_seq_is_ascii_and_bounded(route: str, fuzz: Fuzz) -> None:
    """Found by this file: `Last-Event-ID: <id>:²` and a 5000-digit seq were 500s.

    A seq of up to MAX_SEQ_DIGITS ASCII digits is a position (past the last event: 400);
    anything else is not a `<watcher_id>:<seq>` (400 too, saying so).
    """
    watcher = fuzz.live.watcher()
    url = fuzz.live.url + route.replace("{watcher_id}", watcher)
    try:
        for seq, message in [
            ("9" * MAX_SEQ_DIGITS, "cursor must be between"),
            ("9" * (MAX_SEQ_DIGITS + 1), "Last-Event-ID must be"),
            (HUGE_DIGITS, "Last-Event-ID must be"),
            ("\u00b2", "Last-Event-ID must be"),
        ]:
            headers = {"Last-Event-ID": f"{watcher}:{seq}".encode("latin-1")}
            response = fuzz.live.http.get(url, headers=headers, timeout=REQUEST_TIMEOUT_SECONDS)
            assert response.status_code == 400, (seq[:40], response.text)
            assert message in response.json()["message"]
    finally:
        fuzz.live.reset()


@pytest.mark.parametrize("label", OPERATIONS)
def test_no_server_error(label: str, fuzz: Fuzz) -> None:
    operation = fuzz.schema.find_operation_by_label(label)
    assert operation is not None, f"{label} is not in the served document"
    stateful = operation.path.startswith(STATEFUL_PREFIXES)

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.filter_too_much,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
        ],
    )
    @given(case=cases(operation), data=st.data())
    def check(case: Case, data: st.DataObject) -> None:
        try:
            if data.draw(st.booleans(), label="steered"):
                steer(case, fuzz.live, data)
            cap_waits(case)
            try:
                response = case.call(base_url=fuzz.live.url, timeout=REQUEST_TIMEOUT_SECONDS)
            except requests.Timeout:
                pytest.fail(f"no answer within {REQUEST_TIMEOUT_SECONDS:g} s:\n{case.as_curl_command()}")
        finally:
            if stateful:
                fuzz.live.reset()
        if documented_server_error(case, response):
            case.validate_response(response, checks=[response_schema_conformance])
        else:
            case.validate_response(response, checks=[not_a_server_error, response_schema_conformance])

    check()
