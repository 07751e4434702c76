"""The images a model was shown, kept so that every later request can show them again.

A tool result's images (a `read` of a PNG, a screenshot, an MCP tool's image) are part of the
transcript: the next step, a turn resumed after a restart and a compaction all rebuild the
conversation from the stored rows, and a row must not hold megabytes of base64 that every
event reader would receive. So the bytes live here, content-addressed like the file store's
blobs (`AGENTBOX_HOME/image-blobs/<sha256[:2]>/<sha256>`, written whole or not at all), and
rows and events name an image by its id, `img_<sha256>`, with its media type, size and
dimensions. The id is the address: storing the same image twice stores it once.

Kept apart from the file store's blobs because those are removed with the last file that
names them; an image stays as long as a transcript shows it: deleting a session removes the
images no other session's transcript names (`discard`).

    ImageNotFound   an id that is not `img_<sha256>`, or whose bytes are not here
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from collections.abc import Iterable
from pathlib import Path

from agentbox.store.files import blob_address, write_blob

#: Folder of the image blobs under AGENTBOX_HOME (`images/` holds the sandbox images).
IMAGE_BLOBS_DIR_NAME = "image-blobs"
#: Prefix of an image id; the rest is the sha256 of its bytes.
IMAGE_ID_PREFIX = "img_"
#: Seconds an image stays after it was last stored, whatever `discard` is told.
DISCARD_GRACE_SECONDS = 600.0
IMAGE_ID = re.compile(rf"{IMAGE_ID_PREFIX}([0-9a-f]{{64}})")


class ImageNotFound(LookupError):
    def __init__(self, image_id: str) -> None:
        super().__init__(f"no stored image {image_id!r}")
        self.image_id = image_id


class ImageStore:
    """The image blobs of one AGENTBOX_HOME."""

    def __init__(self, home: Path) -> None:
        self.folder = Path(home) / IMAGE_BLOBS_DIR_NAME

    async def put(self, data: bytes) -> str:
        """Keep `data`; its id. An image kept already is touched: `discard` leaves it alone for
        `DISCARD_GRACE_SECONDS`, the time its new row takes to be written."""
        sha256 = await asyncio.to_thread(write_blob, self.folder, data)
        with contextlib.suppress(FileNotFoundError):
            os.utime(blob_address(self.folder, sha256))
        return IMAGE_ID_PREFIX + sha256

    async def discard(self, image_ids: Iterable[str]) -> int:
        """Remove images no transcript shows any more (a deleted session's); how many went.

        One touched within `DISCARD_GRACE_SECONDS` stays: another session has just stored the
        same bytes and is writing the row that names it."""

        def remove() -> int:
            gone = 0
            for image_id in image_ids:
                match = IMAGE_ID.fullmatch(image_id)
                if match is None:
                    continue
                path = blob_address(self.folder, match[1])
                with contextlib.suppress(FileNotFoundError):
                    if time.time() - path.stat().st_mtime >= DISCARD_GRACE_SECONDS:
                        path.unlink()
                        gone += 1
            return gone

        return await asyncio.to_thread(remove)

    async def get(self, image_id: str) -> bytes:
        """The bytes of a stored image; `ImageNotFound` for a malformed or unknown id."""
        match = IMAGE_ID.fullmatch(image_id)
        if match is None:
            raise ImageNotFound(image_id)
        try:
            return await asyncio.to_thread(blob_address(self.folder, match[1]).read_bytes)
        except FileNotFoundError:
            raise ImageNotFound(image_id) from None
