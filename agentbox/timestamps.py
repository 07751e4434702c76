"""How agentbox writes a moment: RFC 3339 in UTC with milliseconds and `Z`.

One format for every time the API sends and the store keeps (`2026-12-01T15:51:35.350Z`), so a
client parses one shape, and stored times sort as text. Epoch seconds that a wire format fixes
as numbers (a watch event's `timestamp`, a stat's `mtime`) stay numbers; this is for the text.
"""

from __future__ import annotations

from datetime import UTC, datetime


def timestamp(moment: datetime | None = None) -> str:
    """`moment` (now when None; a naive one is taken as local time) in the one format."""
    moment = (moment or datetime.now(UTC)).astimezone(UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def epoch_timestamp(seconds: float) -> str:
    """The moment `seconds` after the Unix epoch (a file's mtime), in the one format."""
    return timestamp(datetime.fromtimestamp(seconds, UTC))


def parse_timestamp(text: str) -> datetime:
    """The aware UTC datetime of a `timestamp()` string."""
    return datetime.fromisoformat(text)
