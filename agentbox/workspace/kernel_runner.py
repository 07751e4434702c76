"""The code interpreter's runner: one Jupyter kernel inside a machine, relayed over stdin/stdout.

This file is not imported by the server: `agentbox.workspace.kernels` runs it with the
machine's own `python3 -c` (the image's jupyter_client, from `python3-ipykernel`), as a
command of the machine, so the kernel lives in the sandbox's namespaces and cgroup and its
ZMQ sockets stay on the sandbox's own loopback. The server talks to it over the command's
pipes, one JSON object a line:

    argv       <kernel name> <max line bytes> <seconds the kernel gets to start>
    in         {"op": "execute", "id": n, "code": "...", "env": {...} | null}
               {"op": "interrupt", "id": n}    (SIGINT to the kernel, at once; the server
                                                no longer reads execution n: only its done comes)
               end of input                    (shut the kernel down and exit)
    out        {"event": "ready"} | {"event": "failed", "reason": "no_kernel" | "start", "message"}
               then, for execution n, in order:
               {"event": "stdout" | "stderr", "id": n, "text"}
               {"event": "result", "id": n, "data": {mime: value}, "main": bool}
               {"event": "error", "id": n, "name", "value", "traceback": [...]}
               {"event": "count", "id": n, "count": k}
               {"event": "oversize", "id": n, "bytes": b}   (a message longer than a line may be)
               {"event": "done", "id": n}
               {"event": "died"}                (the kernel exited; the runner exits too)

The runner moves its channel off fds 0 and 1 and the kernel gets /dev/null there, so what a
cell writes to a raw descriptor does not break the protocol (ipykernel relays fd output as
stream messages). The runner is the sandbox's own process all the same (a cell could reach
its descriptors through /proc), so the server reads its lines as untrusted output: bounded,
type-checked, and able to change only what this sandbox's executions report. Standard
library and jupyter_client only: it runs on the image's Python.

What differs between kernels is a `Dialect`: the code run once at start, how a cell's `env`
is set and restored, and whether a cell's console output needs a fence (below).
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

#: Seconds between checks that the kernel is still alive while waiting for its messages.
POLL_SECONDS = 1.0
#: Milliseconds the runner's IOPub socket waits for a kernel_info's status before asking again
#: (a SUB socket misses what is published before its subscription reaches the kernel).
SUBSCRIBE_POLL_MS = 100
#: Characters a Python kernel's stdout or stderr buffers before it sends them. ipykernel sends
#: what was written every 0.2 s, so a cell printing in a loop would make one message of all
#: it printed meanwhile (hundreds of MB); past this the write sends at once (and waits for it).
STREAM_FLUSH_CHARS = 64 * 1024
#: What a Python kernel runs once started: its streams sent in bounded pieces.
BOUNDED_STREAMS = """
def _agentbox_bound(stream, most):
    write = stream.write
    def bounded(text):
        written = write(text)
        buffer = getattr(stream, "_buffer", None)
        if buffer is not None and buffer.tell() > most:
            stream.flush()
        return written
    stream.write = bounded
import sys as _agentbox_sys
_agentbox_bound(_agentbox_sys.stdout, {most})
_agentbox_bound(_agentbox_sys.stderr, {most})
del _agentbox_bound, _agentbox_sys
"""


def main() -> int:
    kernel_name, max_line, ready_seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    channel = os.fdopen(os.dup(1), "wb")
    inbox = os.fdopen(os.dup(0), "rb")
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    lock = threading.Lock()

    def send(event: dict[str, Any]) -> None:
        line = json.dumps(event, separators=(",", ":")).encode() + b"\n"
        if len(line) > max_line:
            line = (
                json.dumps({"event": "oversize", "id": event.get("id"), "bytes": len(line)}).encode() + b"\n"
            )
        with lock:
            channel.write(line)
            channel.flush()

    try:
        from jupyter_client.kernelspec import NoSuchKernel
        from jupyter_client.manager import KernelManager
    except ImportError as exc:
        send({"event": "failed", "reason": "start", "message": f"jupyter_client is not installed: {exc}"})
        return 1
    os.environ["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"  # no debugger warnings on every start
    manager = KernelManager(kernel_name=kernel_name)
    try:
        manager.start_kernel(stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    except NoSuchKernel:
        send({"event": "failed", "reason": "no_kernel", "message": f"no Jupyter kernel {kernel_name!r}"})
        return 1
    except Exception as exc:
        send({"event": "failed", "reason": "start", "message": f"{type(exc).__name__}: {exc}"})
        return 1
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=ready_seconds)
        kernel = Kernel(manager, client, subscribed_iopub(manager, client, ready_seconds))
    except RuntimeError as exc:
        send({"event": "failed", "reason": "start", "message": str(exc)})
        manager.shutdown_kernel(now=True)
        return 1
    dialect = DIALECTS.get(kernel_name, Dialect())
    if dialect.start:
        quiet(kernel, dialect.start)
    send({"event": "ready"})
    requests: queue.Queue[dict[str, Any] | None] = queue.Queue()
    threading.Thread(target=read_requests, args=(inbox, requests, kernel), daemon=True).start()
    try:
        while (request := requests.get()) is not None:
            execute(kernel, request, send, dialect)
    except KernelDied:
        send({"event": "died"})
        return 1
    finally:
        client.stop_channels()
        if manager.is_alive():
            manager.shutdown_kernel(now=True)
    return 0


class KernelDied(Exception):
    pass


@dataclass
class Kernel:
    """The kernel's manager, its client (for the shell channel), and the runner's own IOPub socket."""

    manager: Any
    client: Any
    iopub: Any
    """A blocking zmq SUB socket (`subscribed_iopub`)."""
    dropped: int = -1
    """The execution the server interrupted and no longer reads: its output is drained unread
    (executions run one at a time, so one id is enough)."""
    answered: set[str] = field(default_factory=set)
    """The requests of this execution whose reply has come on the shell channel."""

    def next_message(self, timeout: float) -> dict[str, Any]:
        """The next IOPub message, its content still packed (`unpacked`); queue.Empty after `timeout`."""
        if not self.iopub.poll(timeout * 1000):
            raise queue.Empty
        _, frames = self.client.session.feed_identities(self.iopub.recv_multipart())
        return self.client.session.deserialize(frames, content=False)

    def replied(self, msg_id: str) -> bool:
        """Whether the kernel's reply to `msg_id` has come on the shell channel. It always does,
        after the request ran; IOPub, which drops what overflows its queues, may have lost the
        request's idle status."""
        while True:
            try:
                reply = self.client.get_shell_msg(timeout=0)
            except queue.Empty:
                return msg_id in self.answered
            self.answered.add(reply.get("parent_header", {}).get("msg_id", ""))

    def unpacked(self, msg: dict[str, Any]) -> dict[str, Any]:
        if isinstance(msg["content"], bytes):
            msg["content"] = self.client.session.unpack(msg["content"])
        return msg


def subscribed_iopub(manager: Any, client: Any, seconds: float) -> Any:
    """A blocking SUB socket on the kernel's IOPub, its subscription in place.

    The client's own channels are asyncio's in jupyter_client 7, each message a trip through
    an event loop, and they parse every message's content: an interrupted flood took longer
    to drain than a busy host gives it. This socket takes a message in a few system calls and
    leaves the content packed until it is kept. kernel_info is asked until a status of the
    kernel's comes through it; the client's IOPub channel is then closed, so nothing buffers
    messages no one reads.
    """
    iopub = manager.connect_iopub()
    deadline = time.monotonic() + seconds
    while True:
        client.kernel_info()
        if iopub.poll(SUBSCRIBE_POLL_MS):
            break
        if time.monotonic() > deadline:
            iopub.close(linger=0)
            raise RuntimeError(f"the kernel's IOPub did not answer in {seconds:g} s")
    while iopub.poll(0):
        iopub.recv_multipart()
    client.iopub_channel.stop()
    drain_shell(client)
    return iopub


def read_requests(inbox: BinaryIO, requests: queue.Queue[dict[str, Any] | None], kernel: Kernel) -> None:
    """Requests from the server: an interrupt acts at once (a cell may be running), the rest queue."""
    for line in inbox:
        try:
            request = json.loads(line)
        except ValueError:
            continue
        if request.get("op") == "interrupt":
            if isinstance(request.get("id"), int):
                kernel.dropped = request["id"]
            if kernel.manager.is_alive():
                kernel.manager.interrupt_kernel()
        elif request.get("op") == "execute":
            requests.put(request)
    requests.put(None)


Send = Callable[[dict[str, Any]], None]


def execute(kernel: Kernel, request: dict[str, Any], send: Send, dialect: Dialect) -> None:
    n, env = request["id"], request.get("env") or {}
    setting = bool(env and dialect.env_set)
    if setting:
        quiet(kernel, dialect.env_set.format(env=json.dumps(env)))
    # Never stop_on_error: executions come one at a time, so the kernel has nothing queued to
    # abort, and its abort window after an error would swallow the next request (the env
    # restore below, or the next cell, on a slow host) with no output at all.
    msg_id = kernel.client.execute(request["code"], allow_stdin=False, stop_on_error=False)
    for msg in messages(kernel, msg_id, dropped=lambda: kernel.dropped == n):
        relay(msg, send, n)
    if dialect.fence:
        fence(kernel, msg_id, dialect.fence, send, n)
    if setting:
        quiet(kernel, dialect.env_restore)
    drain_shell(kernel.client)
    kernel.answered.clear()
    send({"event": "done", "id": n})


def relay(msg: dict[str, Any], send: Send, n: int) -> None:
    """A kernel's message for execution `n` as the runner's event (none for the rest)."""
    kind, content = msg["msg_type"], msg["content"]
    if kind == "stream":
        send({"event": content["name"], "id": n, "text": content["text"]})
    elif kind in ("execute_result", "display_data"):
        send({"event": "result", "id": n, "data": content["data"], "main": kind == "execute_result"})
    elif kind == "error":
        send({"event": "error", "id": n, "name": content["ename"], "value": content["evalue"],
              "traceback": content["traceback"]})  # fmt: skip
    elif kind == "execute_input":
        send({"event": "count", "id": n, "count": content["execution_count"]})


def fence(kernel: Kernel, cell: str, code: str, send: Send, n: int) -> None:
    """Relay the console output a kernel sends after its cell (request `cell`, execution `n`)
    ended, up to a marker.

    Deno's kernel reads a cell's console output from a pipe and sends it under whichever
    execution is the latest when it gets to it, so a cell that prints fast still has output
    on its way when it reports idle, and that output would come under the next cell (its
    results, sent from JavaScript, may come late too). The fence is an execution of its own
    that prints a fresh marker on stdout and on stderr: each stream is one pipe, in order, so
    what comes before the marker is the cell's. The fence itself has no result or error, so
    any that come under it are the cell's as well.
    """
    marker = f"agentbox-fence-{secrets.token_hex(16)}"
    msg_id = kernel.client.execute(code.format(marker=json.dumps(marker)), silent=True,
                                   store_history=False, allow_stdin=False)  # fmt: skip
    pending = {"stdout": "", "stderr": ""}
    for msg in messages(kernel, msg_id, until=lambda: not pending, late=cell):
        name = msg["content"].get("name")
        if msg["parent_header"]["msg_id"] == cell:  # sent before the fence began: no marker in it
            relay(msg, send, n)
            continue
        if msg["msg_type"] != "stream":
            if msg["msg_type"] != "execute_input":  # the fence's own
                relay(msg, send, n)
            continue
        if name not in pending:
            continue
        text = pending[name] + msg["content"]["text"]
        before, found, _ = text.partition(marker)
        if found:
            del pending[name]
        else:  # a marker split over two messages: keep what could be its start
            keep = len(marker) - 1
            before, pending[name] = text[:-keep] if len(text) > keep else "", text[-keep:]
        if before:
            send({"event": name, "id": n, "text": before})


#: What a Python kernel runs before and after a cell given `env`: the variables for that cell only.
ENV_SET = (
    "import os as _agentbox_os\n"
    "_agentbox_env = {env}\n"
    "_agentbox_saved = {{k: _agentbox_os.environ.get(k) for k in _agentbox_env}}\n"
    "_agentbox_os.environ.update(_agentbox_env)\n"
)
ENV_RESTORE = (
    "for _k, _v in _agentbox_saved.items():\n"
    "    _agentbox_os.environ.pop(_k, None) if _v is None else _agentbox_os.environ.__setitem__(_k, _v)\n"
    "del _agentbox_env, _agentbox_saved, _agentbox_os\n"
)


#: The same for Deno's kernel, through `Deno.env` (the kernel runs with every permission).
DENO_ENV_SET = (
    "globalThis.__agentbox_env = {env};\n"
    "globalThis.__agentbox_saved = Object.fromEntries(\n"
    "  Object.keys(globalThis.__agentbox_env).map((k) => [k, Deno.env.get(k)]));\n"
    "for (const [k, v] of Object.entries(globalThis.__agentbox_env)) Deno.env.set(k, v);\n"
)
DENO_ENV_RESTORE = (
    "for (const [k, v] of Object.entries(globalThis.__agentbox_saved)) {{\n"
    "  if (v === undefined) Deno.env.delete(k); else Deno.env.set(k, v);\n"
    "}}\n"
    "delete globalThis.__agentbox_env; delete globalThis.__agentbox_saved;\n"
)
#: What Deno's kernel runs once started: the fence's writer, holding the console's own
#: `log` and `error` (the path the cells' output takes, so the marker comes after it in each
#: stream), so a cell that replaces them (a test's mock) does not silence the fence.
DENO_START = (
    'Object.defineProperty(globalThis, Symbol.for("agentbox.fence"), {value: ((log, error) =>\n'
    "  (marker) => { log(marker); error(marker); })(console.log.bind(console), console.error.bind(console))});\n"
)
#: Deno's fence: the marker on each of its console streams (`fence`).
DENO_FENCE = 'globalThis[Symbol.for("agentbox.fence")]({marker});'


@dataclass(frozen=True)
class Dialect:
    """What the runner does differently for one kernel; a kernel it does not know gets none of it."""

    start: str = ""
    """Run once the kernel is ready."""
    env_set: str = ""
    """Run before a cell given `env` (formatted with `env` as JSON); empty: `env` is not set."""
    env_restore: str = ""
    fence: str = ""
    """Code printing `{marker}` on stdout and stderr, run after each cell (`fence`); empty: none."""


#: The dialect of each kernel, by kernelspec name.
DIALECTS = {
    "python3": Dialect(BOUNDED_STREAMS.format(most=STREAM_FLUSH_CHARS), ENV_SET, ENV_RESTORE),
    "deno": Dialect(DENO_START, DENO_ENV_SET, DENO_ENV_RESTORE, DENO_FENCE),
}


def quiet(kernel: Kernel, code: str) -> None:
    msg_id = kernel.client.execute(code, silent=True, store_history=False, allow_stdin=False)
    for _ in messages(kernel, msg_id):
        pass


def messages(
    kernel: Kernel,
    msg_id: str,
    until: Callable[[], bool] = lambda: True,
    late: str = "",
    dropped: Callable[[], bool] = lambda: False,
) -> Iterator[dict[str, Any]]:
    """The iopub messages of one request until its kernel is idle again and `until()` holds,
    with those of the earlier request `late` that still come meanwhile. Past the idle, or past
    the request's reply on the shell channel (its idle lost), a kernel silent for
    `POLL_SECONDS` has nothing more on its way: the wait ends then too. While `dropped()`, the
    request's own messages are only waited through, their content unread."""
    idle = False
    while not (idle and until()):
        try:
            msg = kernel.next_message(POLL_SECONDS)
        except queue.Empty:
            if not kernel.manager.is_alive():
                raise KernelDied() from None
            if idle or kernel.replied(msg_id):
                return
            continue
        parent = msg.get("parent_header", {}).get("msg_id")
        if parent != msg_id:
            if late and parent == late:
                yield kernel.unpacked(msg)
            continue
        if msg["msg_type"] == "status":
            if kernel.unpacked(msg)["content"].get("execution_state") == "idle":
                idle = True
            continue
        if not dropped():
            yield kernel.unpacked(msg)


def drain_shell(client: Any) -> None:
    """Drop the replies on the shell channel (the iopub messages carried everything)."""
    while True:
        try:
            client.get_shell_msg(timeout=0)
        except queue.Empty:
            return


if __name__ == "__main__":
    sys.exit(main())
