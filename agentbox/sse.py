"""Server-sent events from a byte stream, whatever the chunk boundaries.

A network chunk may end mid-line, mid-JSON, mid-UTF-8 character or between the `\\r` and
`\\n` of a line ending, and may hold several events. The parser keeps what it has not yet
seen the end of and emits an event only at its blank line (the WHATWG rules: `event`,
`data` (joined with newlines), `id`; comments and `retry` ignored).

Standard library only: the model providers (`agentbox.agent.providers.sse`) and the SDK
(`agentbox.client`) both read their streams with it, and the SDK must stay light to import.
"""

from __future__ import annotations

import codecs
from collections.abc import AsyncGenerator, AsyncIterable, Iterable, Iterator
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ServerSentEvent:
    event: str = "message"
    data: str = ""
    id: str | None = None


@dataclass
class SSEParser:
    """Feed text or bytes in any pieces; get back the events completed so far."""

    _decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )
    _buffer: str = ""
    _event: str = ""
    _data: list[str] = field(default_factory=list)
    _id: str | None = None

    def feed(self, chunk: bytes | str) -> list[ServerSentEvent]:
        text = self._decoder.decode(chunk) if isinstance(chunk, bytes) else chunk
        self._buffer += text
        events = []
        for line in self._complete_lines():
            event = self._line(line)
            if event is not None:
                events.append(event)
        return events

    def close(self) -> list[ServerSentEvent]:
        """The end of the stream: a last line without its ending still counts, then a blank line."""
        self._buffer += self._decoder.decode(b"", final=True)
        rest, self._buffer = self._buffer, ""
        events = [e for e in (self._line(rest.rstrip("\r")) if rest else None, self._line("")) if e]
        return events

    def _complete_lines(self) -> list[str]:
        lines: list[str] = []
        while True:
            cut = _line_end(self._buffer)
            if cut is None:
                return lines
            end, after = cut
            lines.append(self._buffer[:end])
            self._buffer = self._buffer[after:]

    def _line(self, line: str) -> ServerSentEvent | None:
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        elif name == "id" and "\0" not in value:
            self._id = value
        return None

    def _dispatch(self) -> ServerSentEvent | None:
        if not self._data:
            self._event = ""
            return None
        event = ServerSentEvent(self._event or "message", "\n".join(self._data), self._id)
        self._event, self._data = "", []
        return event


def _line_end(buffer: str) -> tuple[int, int] | None:
    """(end of the first complete line, start of the next), or None if no line is complete yet.

    A `\\r` at the very end is not complete: its `\\n` may be in the next chunk.
    """
    for index, char in enumerate(buffer):
        if char == "\n":
            return index, index + 1
        if char == "\r":
            if index + 1 == len(buffer):
                return None
            return index, index + (2 if buffer[index + 1] == "\n" else 1)
    return None


def iter_sse(chunks: Iterable[bytes]) -> Iterator[ServerSentEvent]:
    """The events of a byte stream read synchronously (e.g. `httpx.Response.iter_bytes()`)."""
    parser = SSEParser()
    for chunk in chunks:
        yield from parser.feed(chunk)
    yield from parser.close()


async def sse_events(chunks: AsyncIterable[bytes]) -> AsyncGenerator[ServerSentEvent, None]:
    """The events of a byte stream (e.g. `httpx.Response.aiter_bytes()`)."""
    parser = SSEParser()
    async for chunk in chunks:
        for event in parser.feed(chunk):
            yield event
    for event in parser.close():
        yield event
