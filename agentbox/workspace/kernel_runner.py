"""The code interpreter's runner: one Jupyter kernel inside a machine, relayed over stdin/stdout.

This file is not imported by the server: `agentbox.workspace.kernels` runs it with the
machine's own `python3 -c` (the image's jupyter_client, from `python3-ipykernel`), as a
command of the machine, so the kernel lives in the sandbox's namespaces and cgroup and its
ZMQ sockets stay on the sandbox's own loopback. The server talks to it over the command's
pipes, one JSON object a line:

    argv       <kernel name> <max line bytes> <seconds the kernel gets to start>
    in         {"op": "execute", "id": n, "code": "...", "env": {...} | null}
               {"op": "interrupt"}             (SIGINT to the kernel, at once)
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
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

#: Seconds between checks that the kernel is still alive while waiting for its messages.
POLL_SECONDS = 1.0
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
    except RuntimeError as exc:
        send({"event": "failed", "reason": "start", "message": str(exc)})
        manager.shutdown_kernel(now=True)
        return 1
    if kernel_name == "python3":
        quiet(manager, client, BOUNDED_STREAMS.format(most=STREAM_FLUSH_CHARS))
    send({"event": "ready"})
    requests: queue.Queue[dict[str, Any] | None] = queue.Queue()
    threading.Thread(target=read_requests, args=(inbox, requests, manager), daemon=True).start()
    try:
        while (request := requests.get()) is not None:
            execute(manager, client, request, send, kernel_name == "python3")
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


def read_requests(inbox: BinaryIO, requests: queue.Queue[dict[str, Any] | None], manager: Any) -> None:
    """Requests from the server: an interrupt acts at once (a cell may be running), the rest queue."""
    for line in inbox:
        try:
            request = json.loads(line)
        except ValueError:
            continue
        if request.get("op") == "interrupt":
            if manager.is_alive():
                manager.interrupt_kernel()
        elif request.get("op") == "execute":
            requests.put(request)
    requests.put(None)


Send = Callable[[dict[str, Any]], None]


def execute(manager: Any, client: Any, request: dict[str, Any], send: Send, python: bool) -> None:
    n, env = request["id"], request.get("env") or {}
    if env and python:
        quiet(manager, client, ENV_SET.format(env=json.dumps(env)))
    msg_id = client.execute(request["code"], allow_stdin=False, stop_on_error=True)
    for msg in messages(manager, client, msg_id):
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
    if env and python:
        quiet(manager, client, ENV_RESTORE)
    drain_shell(client)
    send({"event": "done", "id": n})


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


def quiet(manager: Any, client: Any, code: str) -> None:
    msg_id = client.execute(code, silent=True, store_history=False, allow_stdin=False)
    for _ in messages(manager, client, msg_id):
        pass


def messages(manager: Any, client: Any, msg_id: str) -> Iterator[dict[str, Any]]:
    """The iopub messages of one request until its kernel is idle again."""
    while True:
        try:
            msg = client.get_iopub_msg(timeout=POLL_SECONDS)
        except queue.Empty:
            if not manager.is_alive():
                raise KernelDied() from None
            continue
        if msg.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "status" and msg["content"].get("execution_state") == "idle":
            return
        yield msg


def drain_shell(client: Any) -> None:
    """Drop the replies on the shell channel (the iopub messages carried everything)."""
    while True:
        try:
            client.get_shell_msg(timeout=0)
        except queue.Empty:
            return


if __name__ == "__main__":
    sys.exit(main())
