"""The images a model is shown: which, how large, and how they reach each provider.

A tool result may carry images (`ImageBlock`: `read` / `read_image` of a picture, an MCP tool's
image). On the way to the model each one goes through:

    vision       the model's `vision` setting (`agent.limits`); off, the image becomes the
                 text `visionUnavailable: <reason>` in the result, so the model knows why it
                 sees no picture (and the provider never gets a request it would refuse)
    fit          long edge at most `MAX_IMAGE_EDGE_PX` (resized, aspect kept), at most
                 `MAX_IMAGE_BYTES_TO_MODEL` as the base64 the provider receives (re-encoded:
                 PNG, then JPEG at falling quality, then smaller), a type every provider takes
                 (`MODEL_MEDIA_TYPES`; others become PNG); more than `MAX_IMAGE_PIXELS` or
                 bytes that do not decode: a text note instead of the image
    stored       the turn's images go to the image store (`store.images`); the result's row
                 and its `agent.tool_result` event name each by id, media type, size and
                 dimensions (`stored_blocks`), never its bytes
    loaded       every request rebuilds the messages from the rows (`load_parts`): the next
                 step, a turn resumed after a restart, a compaction's kept part
    budget       at most `MAX_IMAGES_PER_MESSAGE` images in one provider message (`budget`);
                 past it, each further image is a text note the model reads

A child agent's stored run keeps its images the same way (its rows name them; a resume loads
them); a child whose run is not stored keeps them in memory as they are (`shown_parts`).

Pillow decodes what a tool read; the pixel count is checked from the header before anything
is decoded, so a small file that unpacks to gigapixels costs nothing.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from PIL import Image, UnidentifiedImageError

from agentbox.agent.models import ChatMessage, Part
from agentbox.store.images import ImageNotFound, ImageStore
from agentbox.tools.base import Block, ImageBlock, TextBlock, ToolResult

#: Images one provider message may carry (the results of one step go out as one message);
#: further ones are replaced by `DROPPED_NOTE`.
MAX_IMAGES_PER_MESSAGE = 8
#: Largest image a model is sent, counted as the base64 text it receives (providers cap an
#: image at about 5 MB of it); larger ones are re-encoded until they fit.
MAX_IMAGE_BYTES_TO_MODEL = 4 * 1024 * 1024
#: Longest edge, in pixels, of an image a model is sent; larger ones are resized to it.
MAX_IMAGE_EDGE_PX = 2048
#: Most pixels an image may have to be decoded at all (read from its header first): beyond
#: it the image is not shown, since decoding it would take gigabytes of memory.
MAX_IMAGE_PIXELS = 40_000_000
#: Media types every provider takes as they are; another decodable image is sent as PNG.
MODEL_MEDIA_TYPES = frozenset({"image/png", "image/jpeg", "image/gif", "image/webp"})
#: JPEG qualities tried, in order, for an image too large as PNG.
JPEG_QUALITIES = (85, 70, 55, 40)
#: The text an image past `MAX_IMAGES_PER_MESSAGE` is replaced by.
DROPPED_NOTE = (
    "[image {index} not shown: one message carries at most {limit} images "
    "(MAX_IMAGES_PER_MESSAGE); read it again in a later step to see it]"
)
#: Images one request carries in all, the newest: every stored image of a long transcript
#: would otherwise be read back and sent with every call, and providers cap a request's images
#: (Anthropic also lowers its edge limit past 20). Older ones are named by `OLDER_NOTE`.
MAX_IMAGES_PER_REQUEST = 20
#: The text an image older than the newest `MAX_IMAGES_PER_REQUEST` is replaced by.
OLDER_NOTE = (
    "[image not shown: a request carries only the newest {limit} images of the conversation "
    "(MAX_IMAGES_PER_REQUEST); read it again to see it]"
)
#: The text an image is replaced by for a model without vision.
UNAVAILABLE = "visionUnavailable: {reason}"


@dataclass(frozen=True)
class Vision:
    """Whether the model a request goes to is shown images, and its name for the reason why not."""

    model: str
    enabled: bool = True

    def unavailable(self) -> TextBlock:
        return TextBlock(UNAVAILABLE.format(reason=f"the model {self.model} is configured without vision"))


@dataclass(frozen=True)
class FittedImage:
    """An image as it goes to a model: within the limits above."""

    media_type: str
    data: bytes
    width: int
    height: int

    def block(self) -> ImageBlock:
        return ImageBlock(self.media_type, base64.b64encode(self.data).decode())


def base64_size(size: int) -> int:
    """Characters of the base64 text of `size` bytes."""
    return 4 * math.ceil(size / 3)


def fit(block: ImageBlock) -> FittedImage | str:
    """The image within the limits; a sentence saying why it cannot be shown otherwise."""
    try:
        raw = base64.b64decode(block.data, validate=True)
    except (binascii.Error, ValueError):
        return "its data is not base64"
    try:
        with Image.open(io.BytesIO(raw)) as image:
            width, height = image.size
            if width * height > MAX_IMAGE_PIXELS:
                return f"it has {width}x{height} pixels, more than {MAX_IMAGE_PIXELS} (MAX_IMAGE_PIXELS)"
            media = Image.MIME.get(image.format or "", "")
            if (
                media in MODEL_MEDIA_TYPES
                and max(width, height) <= MAX_IMAGE_EDGE_PX
                and base64_size(len(raw)) <= MAX_IMAGE_BYTES_TO_MODEL
            ):
                return FittedImage(media, raw, width, height)
            image.load()
            return shrink(image)
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        return f"it cannot be decoded ({exc})"


def shrink(image: Image.Image) -> FittedImage:
    """Resize to `MAX_IMAGE_EDGE_PX`, then encode smaller until it is within the byte limit."""
    edge = MAX_IMAGE_EDGE_PX
    while True:
        small = image.copy()
        small.thumbnail((edge, edge), Image.Resampling.LANCZOS, reducing_gap=3.0)
        for media, data in encodings(small):
            if base64_size(len(data)) <= MAX_IMAGE_BYTES_TO_MODEL:
                return FittedImage(media, data, small.width, small.height)
        edge = max(1, edge // 2)


def encodings(image: Image.Image) -> list[tuple[str, bytes]]:
    """PNG first (lossless), then JPEG at each of `JPEG_QUALITIES` (alpha laid on white)."""
    alpha = image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info
    png = (
        image
        if image.mode in ("1", "L", "LA", "P", "RGB", "RGBA")
        else image.convert("RGBA" if alpha else "RGB")
    )
    out = [("image/png", _encode(png, "PNG"))]
    rgb = image.convert("RGBA" if alpha else "RGB")
    if alpha:
        white = Image.new("RGB", rgb.size, "white")
        white.paste(rgb, mask=rgb.getchannel("A"))
        rgb = white
    out += [("image/jpeg", _encode(rgb, "JPEG", quality=q)) for q in JPEG_QUALITIES]
    return out


def _encode(image: Image.Image, kind: str, **options: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, kind, **options)
    return buffer.getvalue()


async def prepared(block: Block, vision: Vision) -> TextBlock | FittedImage:
    """What the model gets for one block of a tool result (fitting runs off the event loop)."""
    if isinstance(block, TextBlock):
        return block
    if not vision.enabled:
        return vision.unavailable()
    fitted = await asyncio.to_thread(fit, block)
    if isinstance(fitted, str):
        return TextBlock(f"[image not shown: {fitted}]")
    return fitted


def image_label(media_type: str, width: int, height: int) -> str:
    """How an image is named in a result's text (the text every reader of the result gets)."""
    return f"[image {media_type} {width}x{height}]"


# ---------------------------------------------------------------- a turn's results: stored


async def stored_blocks(
    blocks: Sequence[Block], vision: Vision, images: ImageStore | None
) -> list[dict[str, Any]]:
    """A result's blocks as its row and `agent.tool_result` keep them: texts, and images by id
    (`{"type": "image", "image_id", "media_type", "bytes", "width", "height"}`); `images` may
    be None only for a model without vision, which is shown none."""
    out: list[dict[str, Any]] = []
    for block in blocks:
        shown = await prepared(block, vision)
        if isinstance(shown, TextBlock):
            out.append({"type": "text", "text": shown.text})
            continue
        assert images is not None, "an image to show needs a store"
        out.append({
            "type": "image", "image_id": await images.put(shown.data), "media_type": shown.media_type,
            "bytes": len(shown.data), "width": shown.width, "height": shown.height,
        })  # fmt: skip
    return out


async def recorded(
    result: ToolResult, vision: Vision, images: ImageStore | None
) -> tuple[str, list[dict[str, Any]]]:
    """(text, blocks) to record for a result: its stored blocks when it shows images; none
    for a text-only result, or without a store (then its images are only named in the text)."""
    if not has_images(result.content) or (images is None and vision.enabled):
        return result.as_text(), []
    stored = await stored_blocks(result.content, vision, images)
    return blocks_text(stored), stored if has_images(stored) else []


def blocks_text(blocks: Sequence[dict[str, Any]]) -> str:
    """The text of stored blocks, each image named by `image_label`."""
    return "\n".join(
        b["text"] if b["type"] == "text" else image_label(b["media_type"], b["width"], b["height"])
        for b in blocks
    )


def has_images(blocks: Sequence[Any]) -> bool:
    return any(
        isinstance(b, ImageBlock) or (isinstance(b, dict) and b.get("type") == "image") for b in blocks
    )


def newest_only(rows: Sequence[Sequence[dict[str, Any]] | None]) -> list[list[dict[str, Any]] | None]:
    """Stored results' blocks with every image but the newest `MAX_IMAGES_PER_REQUEST` of the
    whole transcript turned into `OLDER_NOTE`, before any is read back from the store."""
    left = MAX_IMAGES_PER_REQUEST
    kept: list[list[dict[str, Any]] | None] = []
    for blocks in reversed(rows):
        if blocks is None:
            kept.append(None)
            continue
        out = []
        for b in reversed(blocks):
            if b.get("type") == "image":
                if left <= 0:
                    b = {"type": "text", "text": OLDER_NOTE.format(limit=MAX_IMAGES_PER_REQUEST)}
                left -= 1
            out.append(b)
        kept.append(out[::-1])
    return kept[::-1]


async def load_parts(
    blocks: Sequence[dict[str, Any]], vision: Vision, images: ImageStore
) -> tuple[Part, ...]:
    """The parts of a stored result for a request: each image read back from the store (the
    text `visionUnavailable` for a model since configured without vision)."""
    parts: list[Part] = []
    for b in blocks:
        if b["type"] == "text":
            parts.append(TextBlock(b["text"]))
        elif not vision.enabled:
            parts.append(vision.unavailable())
        else:
            try:
                data = await images.get(b["image_id"])
            except ImageNotFound:
                parts.append(TextBlock(f"[image {b['image_id']} not shown: it is no longer stored]"))
                continue
            parts.append(ImageBlock(b["media_type"], base64.b64encode(data).decode()))
    return tuple(parts)


# ---------------------------------------------------------------- a child's results: in memory


async def shown_parts(blocks: Sequence[Block], vision: Vision) -> tuple[str, tuple[Part, ...]]:
    """A child's result as (text, parts): fitted images kept in memory; parts empty without one."""
    parts: list[Part] = []
    texts: list[str] = []
    for block in blocks:
        shown = await prepared(block, vision)
        if isinstance(shown, TextBlock):
            parts.append(shown)
            texts.append(shown.text)
        else:
            parts.append(shown.block())
            texts.append(image_label(shown.media_type, shown.width, shown.height))
    return "\n".join(texts), tuple(parts) if has_images(parts) else ()


# ---------------------------------------------------------------- every request


def budget(messages: Sequence[ChatMessage]) -> list[ChatMessage]:
    """At most `MAX_IMAGES_PER_MESSAGE` images between two assistant replies: what lies between
    them goes out as one provider message (Anthropic's user message of tool results and text;
    OpenAI's user message of images after the tool messages), so that is what the limit counts.
    A dropped image's note takes its place in the parts and is added to the text."""
    out: list[ChatMessage] = []
    count = 0
    for message in messages:
        if message.role == "assistant":
            count = 0
        parts: list[Part] = []
        notes: list[str] = []
        for part in message.parts:
            if isinstance(part, ImageBlock):
                count += 1
                if count > MAX_IMAGES_PER_MESSAGE:
                    notes.append(DROPPED_NOTE.format(index=count, limit=MAX_IMAGES_PER_MESSAGE))
                    part = TextBlock(notes[-1])
            parts.append(part)
        if notes:
            message = replace(message, text="\n".join([message.text, *notes]), parts=tuple(parts))
        out.append(message)
    return out
