"""`agentbox`: serve the API, run one command in a session's sandbox, or run an agent turn."""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import sys
from collections.abc import Callable, Coroutine, Iterable
from pathlib import Path
from typing import Annotated, Any

import typer

from agentbox import __version__
from agentbox import config as config_mod
from agentbox.config import is_loopback
from agentbox.logs import config as log_config

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="A self-hosted execution environment for AI agents."
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"agentbox {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """Options before any command (`agentbox --version`)."""


#: `agentbox exec`'s status when the program is not there, or there but not executable (the
#: shell's own 127 and 126).
EXIT_NOT_FOUND, EXIT_NOT_EXECUTABLE = 127, 126
#: Port of `agentbox serve` by default (the AIO sandbox's internal API port).
DEFAULT_PORT = 8091
#: Seconds a stopping server lets requests finish before cancelling them (streams under way
#: are ended at once, `end_streams`). Without a bound a request that never ends would hold
#: the stop until a supervisor's SIGKILL, and the sandboxes would be left for the next start.
SHUTDOWN_GRACE_SECONDS = 10


def bind_refusal(host: str, keyed: bool, insecure: bool) -> str | None:
    """Why serving on `host` is refused: an unauthenticated API beyond loopback (`keyed`: the
    server has `api_key` or `[[api_keys]]`)."""
    if is_loopback(host) or keyed or insecure:
        return None
    return (
        f"refusing to bind {host} without an API key: set AGENTBOX_API_KEY (or api_key in agentbox.toml), "
        "or pass --insecure"
    )


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind.")] = DEFAULT_PORT,
    insecure: Annotated[bool, typer.Option(help="Allow a non-loopback bind without an API key.")] = False,
    log_level: Annotated[
        str, typer.Option(help="Log level of agentbox and uvicorn (info adds one access line per request).")
    ] = "warning",
    log_format: Annotated[
        str, typer.Option(help="Log lines as text or json (one object per line).")
    ] = "text",
) -> None:
    """Serve the sandbox API (v2 + AIO v1) on the embedded defaults.

    The server owns its home (`agentbox.home`): a second one on the same home is refused
    before anything starts, and once listening it records its URL for `exec`, `mcp`, `run`.
    """
    from agentbox.home import HomeError, claim_home

    try:
        logging = log_config(log_level, log_format, _request_id)
    except ValueError as exc:
        typer.echo(f"agentbox serve: {exc}", err=True)
        raise typer.Exit(2) from None
    try:
        settings = config_mod.load()
    except config_mod.ConfigError as exc:
        typer.echo(f"agentbox serve: {exc}", err=True)
        raise typer.Exit(2) from None
    settings.bind_host = host
    refusal = bind_refusal(host, settings.keyed, insecure)
    if refusal:
        typer.echo(refusal, err=True)
        raise typer.Exit(2)
    try:
        claim = claim_home(settings)
    except HomeError as exc:
        typer.echo(f"agentbox serve: {exc}", err=True)
        raise typer.Exit(2) from None
    from agentbox.api.app import create_app  # the whole server: after every refusal

    with claim:
        url = f"http://{reachable_host(host)}:{port}"

        def listening() -> None:  # said once the socket accepts, never before a failed bind
            claim.announce(url)
            typer.echo(f"agentbox serving on http://{host}:{port} (home {settings.home})", err=True)

        if not _serve(create_app(settings, claim), host, port, logging, listening):
            typer.echo(f"agentbox serve: could not start on {host}:{port} (the log above says why)", err=True)
            raise typer.Exit(3)


def end_streams(connections: Iterable[Any]) -> None:
    """Close the connections whose response is under way (event and watch streams, which never
    end by themselves; a long download too) as a client hanging up would: the app sees the
    disconnect and ends the response cleanly, and the client reconnects to the next server.
    A connection of a protocol without a request cycle is left to uvicorn's own shutdown."""
    for connection in list(connections):
        cycle = getattr(connection, "cycle", None)
        if cycle is not None and cycle.response_started and not cycle.response_complete:
            connection.transport.close()


def reachable_host(host: str) -> str:
    """How a client on this machine reaches a server bound to `host` (a wildcard: loopback)."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def _request_id() -> str | None:
    """The id of the request being served, for the log lines written while it runs."""
    from agentbox.api.observe import current_request

    state = current_request()
    return None if state is None else state.request_id


def _serve(
    app: object, host: str, port: int, logging: dict[str, Any], on_listening: Callable[[], None]
) -> bool:
    """uvicorn.run, calling `on_listening` once the socket accepts; False if startup failed."""
    import uvicorn

    class Announcing(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                on_listening()

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            for listening in self.servers:  # first: a cut stream's client must not come back here
                listening.close()
            end_streams(self.server_state.connections)
            await super().shutdown(sockets)

    config = uvicorn.Config(
        app, host=host, port=port, log_config=logging, access_log=False,  # type: ignore[arg-type]
        timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS,
    )  # fmt: skip
    server = Announcing(config)
    try:
        server.run()
    except SystemExit as exc:  # uvicorn's own exit when the bind (or the app's start) fails
        if exc.code != uvicorn.config.STARTUP_FAILURE:
            raise
    return bool(server.started)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def exec(
    command: Annotated[list[str], typer.Argument(help="The command and its arguments (after --).")],
    session: Annotated[str, typer.Option(help="Session whose sandbox runs the command.")] = "default",
    machine: Annotated[
        str | None, typer.Option(help="Machine name (default: the configured default).")
    ] = None,
    cwd: Annotated[str | None, typer.Option(help="Working directory inside the machine.")] = None,
) -> None:
    """Run one command in a session's sandbox, stream its output, exit with its code.

    On a home that `agentbox serve` owns, the command runs in that server's sandbox, through
    its command API (`/sandboxes/{session}/v2/commands`); otherwise this process owns the home
    for the while and starts the sandbox itself. A piped stdin (not a terminal) is read whole,
    up to `MAX_INPUT_BYTES`, and handed to the command; a terminal's stdin is not read.
    """
    from agentbox.home import HomeBusy, HomeError

    data = _piped_input()
    try:
        code = asyncio.run(_exec(command, session, machine, cwd, data))
    except HomeBusy as exc:
        if exc.server is None or machine is not None:
            typer.echo(f"agentbox exec: {exc}", err=True)
            raise typer.Exit(2) from None
        code = _exec_remote(command, session, cwd, exc.server.url, data)
    except HomeError as exc:
        typer.echo(f"agentbox exec: {exc}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(code)


def _piped_input() -> bytes | None:
    """What was piped into `agentbox exec`, within the commands' input limit (else exit 2)."""
    from agentbox.workspace.commands import MAX_INPUT_BYTES

    if sys.stdin is None or sys.stdin.isatty():
        return None
    data = sys.stdin.buffer.read(MAX_INPUT_BYTES + 1)
    if len(data) > MAX_INPUT_BYTES:
        typer.echo(
            f"agentbox exec: stdin is larger than the {MAX_INPUT_BYTES} bytes a command takes", err=True
        )
        raise typer.Exit(2)
    return data


#: Seconds each poll of a command run through a server waits for it to end (output is printed between polls).
EXEC_POLL_WAIT_S = 1.0


def _exec_remote(argv: list[str], session: str, cwd: str | None, url: str, data: bytes | None) -> int:
    """`agentbox exec` through the server that owns the home: the command runs in its sandbox of
    `session` (started, then polled with `wait` until it ends), its output printed as it grows."""
    import shlex

    from agentbox.client import AgentboxError, Client

    command = argv[0] if len(argv) == 1 else shlex.join(argv)
    try:
        with Client(url, config_mod.load().api_key) as client:
            sandbox = client.sandbox(session)
            done = sandbox.start(command, cwd=cwd, stdin=data)
            shown = {"stdout": 0, "stderr": 0}
            while True:
                _print_new(done.raw, shown)
                if done.status != "running":
                    break
                done = sandbox.command(done.command_id, wait=EXEC_POLL_WAIT_S)
    except AgentboxError as exc:
        typer.echo(f"agentbox exec: {exc}", err=True)
        raise typer.Exit(2) from None
    if done.error:
        typer.echo(f"agentbox exec: the command could not run: {done.error}", err=True)
        raise typer.Exit(2)
    return done.exit_code if done.exit_code is not None else 1


def _print_new(data: dict[str, Any], shown: dict[str, int]) -> None:
    """Write the part of each stream not written yet (unless the server cut it meanwhile: then
    a note on stderr says the rest is not streamed)."""
    for name, out in (("stdout", sys.stdout), ("stderr", sys.stderr)):
        text = str(data.get(name) or "")
        if data.get(f"{name}_truncated"):
            if shown[name] >= 0:
                sys.stderr.write(f"[agentbox: {name} was cut by the server; the rest is not shown]\n")
            shown[name] = -1
            continue
        if shown[name] >= 0 and len(text) > shown[name]:
            out.buffer.write(text[shown[name] :].encode())
            out.flush()
            shown[name] = len(text)


async def _exec(
    argv: list[str], session: str, machine_name: str | None, cwd: str | None, data: bytes | None
) -> int:
    from agentbox.machines.base import ExecRequest, iter_output
    from agentbox.machines.errors import MachineError
    from agentbox.system import opened_system
    from agentbox.tools.shell import cwd_problem

    async with opened_system(config_mod.load(), turns=False) as system:
        try:
            m = (await system.services.get(session, machine_name)).machine
        except MachineError as exc:
            typer.echo(f"agentbox exec: {exc}", err=True)
            return 2
        problem = await cwd_problem(m, cwd) if cwd is not None else None
        if problem is not None:
            typer.echo(f"agentbox exec: {problem}", err=True)
            return 2
        shape = {"argv": tuple(argv)} if len(argv) > 1 else {"command": argv[0]}
        request = ExecRequest(**shape, cwd=cwd, interactive=data is not None)  # type: ignore[arg-type]
        try:
            process = await m.spawn(request)
            if data is not None:
                await process.write_stdin(data)
                await process.close_stdin()
            async for stream, chunk in iter_output(process):
                out = sys.stdout.buffer if stream == "stdout" else sys.stderr.buffer
                out.write(chunk)
                out.flush()
            return await process.wait()
        except MachineError as exc:  # the machine failed to start or its transport broke
            typer.echo(f"agentbox exec: {exc}", err=True)
            return 2
        except OSError as exc:  # the program is missing or not executable inside the machine
            typer.echo(f"agentbox exec: cannot run {argv[0]!r}: {exc.strerror or exc}", err=True)
            return EXIT_NOT_FOUND if exc.errno == errno.ENOENT else EXIT_NOT_EXECUTABLE


@app.command("mcp")
def mcp_command(
    session: Annotated[str, typer.Option(help="Session whose machine the tools act on.")] = "default",
    toolset: Annotated[str, typer.Option(help="Toolset: default, workbench or flue.")] = "default",
    machine: Annotated[
        str | None, typer.Option(help="Machine name (default: the configured default).")
    ] = None,
    client_approves: Annotated[
        bool,
        typer.Option(
            help="The MCP client confirms every call with its user: serve full-auto, also on a machine "
            "that is not isolated where its config entry has allow_full_auto = true (otherwise calls that "
            "need approval there are refused)."
        ),
    ] = False,
) -> None:
    """Serve a session's tools over MCP on stdin/stdout (for Claude Code, Cursor, any MCP client)."""
    from agentbox.home import HomeBusy, HomeError
    from agentbox.machines.errors import MachineError
    from agentbox.mcp import ChoiceError, serve_stdio

    settings = config_mod.load()
    try:
        asyncio.run(serve_stdio(settings, session, toolset, machine, client_approves=client_approves))
    except HomeBusy as exc:
        hint = f": point the MCP client at {exc.server.url}/mcp instead" if exc.server else ""
        typer.echo(f"agentbox mcp: {exc}{hint}", err=True)
        raise typer.Exit(2) from None
    except (ChoiceError, MachineError, HomeError) as exc:
        typer.echo(f"agentbox mcp: {exc}", err=True)
        raise typer.Exit(2) from None


@app.command("encrypt-secret")
def encrypt_secret(value: Annotated[str, typer.Argument(help="A password, key or token to store.")]) -> None:
    """Print `enc:...` for a machine's secret field in agentbox.toml (key under AGENTBOX_HOME)."""
    from agentbox.home import HomeError, prepare_home
    from agentbox.secrets import SecretBox

    settings = config_mod.load()
    try:
        prepare_home(settings)
    except HomeError as exc:
        typer.echo(f"agentbox encrypt-secret: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(SecretBox(settings.home).encrypt(value))


@app.command()
def machines() -> None:
    """List configured machines (secret fields redacted)."""
    import json

    from agentbox.machines.registry import Registry

    typer.echo(json.dumps(Registry(config_mod.load()).describe(), indent=2))


#: `--url`: run against a server instead of in-process.
UrlOption = Annotated[
    str | None,
    typer.Option(
        help="An `agentbox serve` to run against (e.g. http://127.0.0.1:8091) instead of in-process."
    ),
]
#: `--api-key`: the server's key (sent as a bearer token); only with `--url`.
ApiKeyOption = Annotated[
    str | None,
    typer.Option(envvar="AGENTBOX_API_KEY", show_default=False, help="The server's API key (with --url)."),
]


@app.command()
def run(
    task: Annotated[str, typer.Argument(help="What the agent should do.")],
    model: Annotated[
        str, typer.Option(help='"scripted" (needs --script) or "<provider>:<name>".')
    ] = "scripted",
    mode: Annotated[
        str | None,
        typer.Option(
            help="Permission tier: read-only, workspace-write, full-ask, full-auto or plan (default: the "
            "machine's; full-auto in a sandbox, full-ask on the host)."
        ),
    ] = None,
    session: Annotated[str | None, typer.Option(help="Run in this existing session.")] = None,
    script: Annotated[Path | None, typer.Option(help="JSON list of steps for the scripted model.")] = None,
    instructions: Annotated[str | None, typer.Option(help="The new session's instructions.")] = None,
    option: Annotated[
        list[str] | None,
        typer.Option(help="A model option KEY=VALUE (base_url, api_key, context_window, temperature, ...)."),
    ] = None,
    machine: Annotated[
        str | None, typer.Option(help='The new session\'s machine ("none": no sandbox).')
    ] = None,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Run one turn and show it live; exit 0 completed, 1 failed, 2 aborted, 3 refused or unreachable."""
    from rich.console import Console

    from agentbox import cli_run

    opts = cli_run.RunOptions(
        task=task, model=model, mode=mode, session=session, script=script,
        instructions=instructions, options=tuple(option or ()), machine=machine,
    )  # fmt: skip
    if url is None:
        raise typer.Exit(_in_process("run", cli_run.run_turn(opts, Console())))
    raise typer.Exit(asyncio.run(cli_run.run_remote(opts, Console(), url, api_key)))


@app.command()
def sessions(url: UrlOption = None, api_key: ApiKeyOption = None) -> None:
    """List sessions: id, model, status, created."""
    from rich.console import Console

    from agentbox import cli_run

    if url is None:
        if not _has_database("sessions"):
            raise typer.Exit(0)  # no sessions: nothing to list, and nothing is made
        raise typer.Exit(_in_process("sessions", cli_run.list_sessions(Console())))
    raise typer.Exit(asyncio.run(cli_run.list_remote_sessions(Console(), url, api_key)))


@app.command()
def events(
    session_id: Annotated[str, typer.Argument(help="The session.")],
    after: Annotated[int, typer.Option(min=0, help="Only events with a greater seq.")] = 0,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Print a session's events, one line each."""
    from rich.console import Console

    from agentbox import cli_run

    if url is None:
        if not _has_database("events"):
            raise typer.Exit(cli_run.EXIT_REFUSED)  # no session of that id, and nothing is made
        raise typer.Exit(_in_process("events", cli_run.print_events(Console(), session_id, after)))
    raise typer.Exit(asyncio.run(cli_run.print_remote_events(Console(), session_id, after, url, api_key)))


@app.command()
def doctor(
    as_json: Annotated[bool, typer.Option("--json", help="Print the checks as JSON.")] = False,
) -> None:
    """Check what this host gives sandboxes and what each missing piece costs; exit 1 if an essential one is missing."""
    import json

    from rich.console import Console

    from agentbox import doctor as doctor_mod

    settings = config_mod.load()
    checks = doctor_mod.run_checks(settings.home, settings.sandbox_uid, settings.images)
    if as_json:
        typer.echo(json.dumps(doctor_mod.as_json(checks), indent=2))
    else:
        doctor_mod.render(checks, Console())
    raise typer.Exit(0 if doctor_mod.essential_ok(checks) else 1)


def _has_database(command: str) -> bool:
    """Whether the home has a database to read; if not, one line says so (a read-only command
    must not make a home as a side effect)."""
    from agentbox.store.db import DB_FILE_NAME

    home = config_mod.load().home
    if (home / DB_FILE_NAME).exists():
        return True
    typer.echo(
        f"agentbox {command}: no sessions yet: {home} has no database (serve, run and exec make one)",
        err=True,
    )
    return False


def _in_process(command: str, work: Coroutine[Any, Any, int]) -> int:
    """Run `work` on the home, owned by this process for the while; when another process owns it
    (a server: the message names its URL, for `--url`), one line and the refused exit status."""
    from agentbox.cli_run import EXIT_REFUSED
    from agentbox.home import HomeBusy, HomeError

    try:
        return asyncio.run(work)
    except HomeError as exc:
        server = exc.server if isinstance(exc, HomeBusy) else None
        hint = f": use --url {server.url}" if server is not None else ""
        typer.echo(f"agentbox {command}: {exc}{hint}", err=True)
        return EXIT_REFUSED


def _add_image_commands() -> None:
    from agentbox.cli_image import app as image_app

    app.add_typer(image_app, name="image")


_add_image_commands()


def main() -> None:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    app()


if __name__ == "__main__":
    main()
