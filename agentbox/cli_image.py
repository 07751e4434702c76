"""`agentbox image build | list | rm`: the root filesystems sandboxes run on (`machines/images.py`)."""

from __future__ import annotations

import json
import time
from typing import Annotated

import typer

from agentbox import config as config_mod
from agentbox.home import HomeError
from agentbox.machines.errors import ImageError
from agentbox.machines.images import PROFILES, ImageStore

app = typer.Typer(no_args_is_help=True, help="Build, list and remove sandbox images.")


def _store(prepare: bool = False) -> ImageStore:
    """The server's images, owned by the uid its sandboxes run as; `prepare`: make the home ready
    first (a root server's home must let the sandbox uid reach its images)."""
    import os

    from agentbox.home import prepare_home

    settings = config_mod.load()
    if prepare:
        prepare_home(settings)
    root = os.geteuid() == 0
    uid = settings.sandbox_uid if root else os.geteuid()
    gid = settings.sandbox_uid if root else os.getegid()
    return ImageStore(settings.images, uid, gid)


def _fail(command: str, exc: Exception) -> typer.Exit:
    typer.echo(f"agentbox image {command}: {exc}", err=True)
    return typer.Exit(2)


@app.command()
def build(
    name: Annotated[str, typer.Argument(help="The image's name, e.g. base or data.")],
    profile: Annotated[str, typer.Option(help=f"What it is made of: {', '.join(PROFILES)}.")] = "base",
    include: Annotated[
        str, typer.Option(help="More Debian packages, comma-separated (e.g. jq,sqlite3).")
    ] = "",
    rebuild: Annotated[bool, typer.Option(help="Build again even when nothing asked for changed.")] = False,
) -> None:
    """Build an image from Debian bookworm packages with mmdebstrap (a no-op when it is up to date)."""
    from rich.console import Console

    console = Console(stderr=True)
    try:
        request = _store().request(name, profile, tuple(include.split(",")))
        store = _store(prepare=True)
        started = time.monotonic()
        with console.status(f"building {name}…") as status:

            def progress(line: str) -> None:
                text = f"{name} {time.monotonic() - started:5.0f} s  {line[:110]}"
                if console.is_terminal:
                    status.update(text)
                else:  # a log, not a terminal: one line per step
                    console.print(text, markup=False, highlight=False)

            image = store.build(request, progress, rebuild=rebuild)
    except (ImageError, HomeError, OSError) as exc:
        raise _fail("build", exc) from None
    m = image.manifest
    typer.echo(f"{m.name}\t{m.profile}\t{len(m.packages)} packages\t{m.size / 1e6:.0f} MB\t{m.digest}")


@app.command("list")
def list_images(
    as_json: Annotated[bool, typer.Option("--json", help="Print the manifests as JSON.")] = False,
) -> None:
    """One image a line: name, profile, packages, size, digest, when it was built."""
    images = _store().all()
    if as_json:
        typer.echo(json.dumps([_summary(i.manifest) for i in images], indent=2))
        return
    for image in images:
        m = image.manifest
        built = time.strftime("%Y-%m-%d %H:%M", time.localtime(m.created))
        typer.echo(
            f"{m.name}\t{m.profile}\t{len(m.packages)} packages\t{m.size / 1e6:.0f} MB\t{m.digest}\t{built}"
        )


def _summary(manifest: object) -> dict[str, object]:
    from dataclasses import asdict

    data = asdict(manifest)  # type: ignore[call-overload]
    data["package_count"] = len(data["packages"])
    return dict(data)


@app.command()
def rm(name: Annotated[str, typer.Argument(help="The image to remove.")]) -> None:
    """Remove an image (refused while a sandbox runs on it)."""
    try:
        _store().remove(name)
    except ImageError as exc:
        raise _fail("rm", exc) from None
    typer.echo(f"removed {name}")
