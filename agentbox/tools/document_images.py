"""Images `read` attaches to a document's text: rendered PDF pages, DOCX pictures, a note's images.

`includeImages` says which:

    auto    PDF pages without a text layer, or the pages asked for by `page` / `block`, on the
            first window of a read (a continuation by `offset` does not send them again);
            a DOCX's pictures when it has no text at all
    always  the pages read (at most MAX_RENDERED_PAGES of them), a DOCX's pictures, a Markdown
            note's local images (at most MAX_ATTACHED_IMAGES), even when there is text
    none    nothing

Each image goes to the model as a caption and an image block; the result's `documentImages`
lists them (id, page, caption, media type, pixel size, bytes), never their bytes: the
payload goes to events and APIs, where base64 would only weigh.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from typing import Literal

from PIL import Image

from agentbox.tools.base import ImageBlock, TextBlock, ToolResult
from agentbox.tools.pdf import PdfPage

#: DOCX pictures or note images one read attaches.
MAX_ATTACHED_IMAGES = 4

IncludeImages = Literal["auto", "always", "none"]


@dataclass(frozen=True)
class Attached:
    """One image for the model: what it shows (caption), its bytes and, for a page, its number."""

    caption: str
    media_type: str
    data: bytes
    page: int | None = None


def pages_to_render(
    mode: IncludeImages, pages: list[PdfPage], *, chosen: bool, first_window: bool
) -> list[int]:
    """The page numbers `mode` renders of the `pages` read (`chosen`: by `page` or `block`)."""
    if mode == "always":
        return [p.number for p in pages]
    if mode == "none" or not first_window:
        return []
    return [p.number for p in pages if chosen or not p.has_text]


def pixel_size(data: bytes) -> tuple[int, int] | None:
    """Width and height from the image's header (nothing is decoded), None when unreadable."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.width, image.height
    except Exception:  # untrusted bytes: PIL raises many types
        return None


def attach(result: ToolResult, images: list[Attached], wanted: int, limit: int) -> ToolResult:
    """`result` with `images` appended (each after its caption) and listed in `documentImages`;
    `wanted` is how many were eligible, so a cut at `limit` is said."""
    entries = []
    for n, image in enumerate(images, start=1):
        ident = f"image-{n}"
        size = pixel_size(image.data)
        dims = f", {size[0]}x{size[1]} px" if size else ""
        result.content.append(
            TextBlock(f"[{ident}: {image.caption} ({image.media_type}{dims}, {len(image.data)} bytes)]")
        )
        result.content.append(ImageBlock(image.media_type, base64.b64encode(image.data).decode()))
        entries.append(
            {
                "id": ident,
                "page": image.page,
                "caption": image.caption,
                "mediaType": image.media_type,
                "width": size[0] if size else None,
                "height": size[1] if size else None,
                "bytes": len(image.data),
            }
        )
    if wanted > len(images):
        result.content.append(
            TextBlock(f"[{wanted} images qualify; the first {limit} are attached, at most {limit} a read.]")
        )
    result.data["documentImages"] = entries
    return result
