"""The few calls of the Docker Engine API that the `docker` machine kind makes.

The Engine API is JSON over HTTP on the daemon's socket, and httpx (already a dependency of
the server) speaks it, socket included. A Docker SDK would add a dependency for ten calls:
aiodocker brings aiohttp and its six helper packages and has no call for `docker import`
(its `import_image` is `docker load`); docker-py is synchronous (a thread per call) and
brings requests. None of these calls is on a command's path: commands go through the exec
agent, never through the engine.

Paths are unversioned, so the daemon answers in its own API version; `ping` checks that it
is at least MIN_API_VERSION, the version whose fields this module sends (Docker 20.10).

Failures, all `MachineUnavailable` (errors.py): the daemon cannot be reached, or answers
with an error (its own message quoted); `ContainerGone` for a container it does not know.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from agentbox.machines.errors import ContainerGone, MachineUnavailable

#: The engine the operator's dockerd listens on by default.
DEFAULT_DOCKER_HOST = "unix:///var/run/docker.sock"
#: The oldest Engine API whose container fields this module relies on (Docker 20.10).
MIN_API_VERSION = (1, 41)
#: Seconds to reach the daemon before it counts as unreachable.
CONNECT_TIMEOUT = 5.0
#: Seconds one ordinary API call may take (a container's start under load included).
CALL_TIMEOUT = 60.0
#: Bytes of a container's log kept for an error message.
LOG_TAIL_BYTES = 2000
#: The 8-byte header of each frame of a multiplexed (non-tty) log stream.
FRAME_HEADER = 8


class Engine:
    """One daemon, at `docker_host` (`unix:///path` or `tcp://host:port`, without TLS)."""

    def __init__(self, docker_host: str = DEFAULT_DOCKER_HOST) -> None:
        self.docker_host = docker_host
        if docker_host.startswith("unix://"):
            self._uds: str | None = docker_host.removeprefix("unix://")
            self._base = "http://docker"
        elif docker_host.startswith("tcp://"):
            self._uds = None
            self._base = "http://" + docker_host.removeprefix("tcp://")
        else:
            raise ValueError(f"docker_host {docker_host!r}: use unix:///path or tcp://host:port")
        self._clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}

    def _client(self) -> httpx.AsyncClient:
        """A client of the running loop: its pooled connections belong to that loop."""
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            for old in [lp for lp in self._clients if lp.is_closed()]:
                del self._clients[old]
            transport = httpx.AsyncHTTPTransport(uds=self._uds) if self._uds else httpx.AsyncHTTPTransport()
            timeout = httpx.Timeout(CALL_TIMEOUT, connect=CONNECT_TIMEOUT)
            client = httpx.AsyncClient(transport=transport, base_url=self._base, timeout=timeout)
            self._clients[loop] = client
        return client

    async def aclose(self) -> None:
        client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()

    async def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return await self._client().request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise MachineUnavailable(
                f"cannot reach the Docker engine at {self.docker_host}: {exc or type(exc).__name__}"
            ) from exc

    async def _call(self, method: str, path: str, *, container: str = "", **kwargs: Any) -> httpx.Response:
        """One call; with `container`, a 404 means that container is gone (`ContainerGone`)."""
        response = await self._send(method, path, **kwargs)
        if response.status_code == 404 and container:
            raise ContainerGone(f"no container {container[:12]} on {self.docker_host}", path=container)
        if response.status_code >= 400:
            raise _refusal(response, path)
        return response

    # the daemon --------------------------------------------------------------------------

    async def ping(self) -> str:
        """The daemon's API version; MachineUnavailable when it is absent or too old."""
        version = (await self._call("GET", "/version")).json().get("ApiVersion", "0.0")
        if tuple(int(p) for p in version.split(".")[:2]) < MIN_API_VERSION:
            raise MachineUnavailable(
                f"the Docker engine at {self.docker_host} speaks API {version}; agentbox needs "
                f"{'.'.join(map(str, MIN_API_VERSION))} or later (Docker 20.10)"
            )
        return str(version)

    # images ------------------------------------------------------------------------------

    async def image_exists(self, reference: str) -> bool:
        response = await self._send("GET", f"/images/{reference}/json")
        if response.status_code == 404:
            return False
        if response.status_code >= 400:
            raise _refusal(response, "/images")
        return True

    async def import_image(self, repo: str, tag: str, tar: AsyncIterator[bytes]) -> str:
        """`docker import` of a root filesystem tar stream as `repo:tag`; its image id."""
        params = {"fromSrc": "-", "repo": repo, "tag": tag}
        client = self._client()
        request = client.build_request(
            "POST", "/images/create", params=params, content=tar,
            headers={"Content-Type": "application/x-tar"}, timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT),
        )  # fmt: skip
        try:
            response = await client.send(request)
        except httpx.TransportError as exc:
            raise MachineUnavailable(f"importing {repo}:{tag} into {self.docker_host} failed: {exc}") from exc
        if response.status_code >= 400:
            raise _refusal(response, "/images/create")
        image_id = ""
        for line in response.text.splitlines():  # one JSON object per progress message
            message = json.loads(line) if line.strip() else {}
            if message.get("error"):
                raise MachineUnavailable(f"importing {repo}:{tag} failed: {message['error']}")
            image_id = message.get("status", image_id)
        return str(image_id)

    async def network_exists(self, name: str) -> bool:
        response = await self._send("GET", f"/networks/{name}")
        if response.status_code == 404:
            return False
        if response.status_code >= 400:
            raise _refusal(response, "/networks")
        return True

    # containers --------------------------------------------------------------------------

    async def create(self, name: str, config: dict[str, Any]) -> str | None:
        """The new container's id; None when a container of that name exists already."""
        response = await self._send("POST", "/containers/create", params={"name": name}, json=config)
        if response.status_code == 409:
            return None
        if response.status_code >= 400:
            raise _refusal(response, "/containers/create")
        return str(response.json()["Id"])

    async def containers(self, label: str) -> list[dict[str, Any]]:
        """Every container, running or not, that carries `label` (`key=value`)."""
        filters = json.dumps({"label": [label]})
        response = await self._send("GET", "/containers/json", params={"all": "1", "filters": filters})
        if response.status_code >= 400:
            raise _refusal(response, "/containers/json")
        return list(response.json())

    async def inspect(self, container: str) -> dict[str, Any]:
        """The container's state and configuration; ContainerGone when the daemon has none."""
        return dict((await self._call("GET", f"/containers/{container}/json", container=container)).json())

    async def start(self, container: str) -> None:
        await self._call(
            "POST", f"/containers/{container}/start", container=container
        )  # 304: already running

    async def stop(self, container: str, grace: int) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds; returns once it has exited."""
        await self._call(
            "POST",
            f"/containers/{container}/stop",
            params={"t": grace},
            timeout=CALL_TIMEOUT + grace,
            container=container,
        )

    async def kill(self, container: str) -> None:
        try:
            await self._call("POST", f"/containers/{container}/kill", container=container)
        except ContainerGone:
            raise
        except MachineUnavailable as exc:
            if "is not running" not in exc.message:  # 409: nothing to kill
                raise

    async def wait_exit(self, container: str) -> int:
        """Block until the container is not running (at once if it is not); its exit code."""
        response = await self._call(
            "POST",
            f"/containers/{container}/wait",
            params={"condition": "not-running"},
            timeout=None,
            container=container,
        )
        return int(response.json().get("StatusCode", -1))

    async def remove(self, container: str) -> None:
        """Remove the container and its anonymous volumes, running or not; gone already is fine."""
        try:
            await self._call(
                "DELETE", f"/containers/{container}", params={"force": "1", "v": "1"}, container=container
            )
        except ContainerGone:
            return

    async def logs(self, container: str) -> str:
        """The end of what the container's pid 1 wrote (its stdout and stderr)."""
        response = await self._call(
            "GET",
            f"/containers/{container}/logs",
            params={"stdout": "1", "stderr": "1", "tail": "50"},
            container=container,
        )
        return demultiplex(response.content)[-LOG_TAIL_BYTES:].decode(errors="replace")


def demultiplex(stream: bytes) -> bytes:
    """The payload of a non-tty log stream: frames of [kind, 0, 0, 0, size (4 bytes BE)] + data."""
    out, at = bytearray(), 0
    while at + FRAME_HEADER <= len(stream):
        size = int.from_bytes(stream[at + 4 : at + FRAME_HEADER], "big")
        out += stream[at + FRAME_HEADER : at + FRAME_HEADER + size]
        at += FRAME_HEADER + size
    return bytes(out)


def _refusal(response: httpx.Response, path: str) -> MachineUnavailable:
    try:
        message = str(response.json().get("message") or response.text)
    except ValueError:
        message = response.text
    return MachineUnavailable(f"the Docker engine refused {path} ({response.status_code}): {message.strip()}")
