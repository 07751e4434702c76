"""The images a Markdown note references (`![alt](src)`), as files of the knowledge base.

The note is parsed with markdown-it (CommonMark), not a pattern: `![a](<my pic.png>)`,
`![a](fig(1).png)`, `![a](a\\(b\\).png)` and reference images (`![a][ref]`) are images, and
`![a](x.png)` inside a code span or block is not. A source is percent-decoded as a renderer
would (`my%20pic.png` is `my pic.png`) and loses its `?query` and `#fragment`.

A relative source is taken from the note's folder and reported relative to the root of the
note's knowledge base (the workspace root unless the note is in another one). Sources that are not files of the knowledge base are listed with
why they are skipped, never opened:

    remote                  a URL with a scheme (https:, data:, ...) or `//host`
    absolute                a path from `/`: notes are read on more than one machine
    escapes-knowledge-base  leads out of the note's knowledge base, by `..` or through a link

Whether a file exists is asked of the machine (`file_ops`), so it is what the machine sees.
"""

from __future__ import annotations

import posixpath
import re
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from markdown_it import MarkdownIt
from markdown_it.token import Token

from agentbox.machines.base import Machine
from agentbox.machines.errors import MachineError, PathEscape
from agentbox.workspace.errors import WorkspaceError
from agentbox.workspace.fileops import file_ops, within

#: Image references one read reports; a note with more says how many were left out.
MAX_IMAGE_REFS = 200

Skip = Literal["remote", "absolute", "escapes-knowledge-base"]
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_PARSER = MarkdownIt("commonmark")


@dataclass(frozen=True)
class ImageRef:
    src: str  # as written, decoded
    alt: str
    path: str | None  # relative to the workspace root; None when skipped
    inside: str | None  # the machine's path of it; None when skipped
    exists: bool
    skipped: Skip | None
    file_id: str | None = None  # the id `read` takes, when the tools record ids and it exists

    def to_dict(self) -> dict[str, Any]:
        return {
            "src": self.src,
            "alt": self.alt,
            "path": self.path,
            "fileId": self.file_id,
            "exists": self.exists,
            "skipped": self.skipped,
        }


def image_sources(text: str) -> list[tuple[str, str]]:
    """(src, alt) of every image in the note, in order."""
    return [(str(t.attrs.get("src", "")), t.content) for t in images(_PARSER.parse(text))]


def images(tokens: list[Token]) -> Iterator[Token]:
    for token in tokens:
        if token.type == "image":
            yield token
        if token.children:
            yield from images(token.children)


def local_part(src: str) -> str:
    """The file a relative source names: without `?query` / `#fragment`, percent-decoded."""
    path = re.split(r"[?#]", src, maxsplit=1)[0]
    return urllib.parse.unquote(path)


def skip_reason(src: str) -> Skip | None:
    if _SCHEME.match(src) or src.startswith("//"):
        return "remote"
    if src.startswith("/"):
        return "absolute"
    return None


async def image_refs(machine: Machine, note: str, text: str, root: str) -> tuple[list[ImageRef], int]:
    """The note's image references (at most MAX_IMAGE_REFS) and how many it has in all; `root`
    is the note's knowledge base's folder."""
    sources = image_sources(text)
    refs = [await image_ref(machine, note, src, alt, root) for src, alt in sources[:MAX_IMAGE_REFS]]
    return refs, len(sources)


async def image_ref(machine: Machine, note: str, src: str, alt: str, root: str) -> ImageRef:
    reason = skip_reason(src)
    decoded = urllib.parse.unquote(src)
    if reason is not None:
        return ImageRef(decoded, alt, None, None, False, reason)
    ops = file_ops(machine)
    root = root.rstrip("/") or "/"
    wanted = posixpath.normpath(posixpath.join(posixpath.dirname(note), local_part(src)))
    if not (ops.within_root(wanted) and within(root, wanted)):
        return ImageRef(decoded, alt, None, None, False, "escapes-knowledge-base")
    try:
        target = ops.resolve(wanted)
        if not (ops.within_root(target.inside) and within(root, target.inside)):
            return ImageRef(decoded, alt, None, None, False, "escapes-knowledge-base")
        st = await ops.lstat(target.inside, follow=True)
    except PathEscape:
        return ImageRef(decoded, alt, None, None, False, "escapes-knowledge-base")
    except (OSError, MachineError, WorkspaceError):
        st = None
    relative = posixpath.relpath(wanted, root)
    return ImageRef(decoded, alt, relative, wanted, st is not None and st.is_file, None)
