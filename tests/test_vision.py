"""Images of tool results reach the model as images, in each provider's format.

Real parts: `agentbox serve` (uvicorn on loopback, a SQLite file, bubblewrap sandboxes), the
real `read_file` tool reading PNGs written into the sandbox, the `openai:` and `anthropic:`
adapters over HTTP. The models are loopback servers speaking each wire protocol; they record
every request, and the tests decode the images in them with Pillow. The limits
(`agent.vision`) are also checked at their boundaries on `fit` and `budget` directly.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image, PngImagePlugin

from agentbox.agent.compaction import IMAGE_TOKENS, estimate_tokens, summary_request
from agentbox.agent.limits import LimitsError, check_limit_options, model_limits
from agentbox.agent.models import ChatMessage, ToolCall
from agentbox.agent.providers.anthropic import to_messages as anthropic_messages
from agentbox.agent.vision import (
    MAX_IMAGE_BYTES_TO_MODEL,
    MAX_IMAGE_EDGE_PX,
    MAX_IMAGE_PIXELS,
    MAX_IMAGES_PER_MESSAGE,
    MAX_IMAGES_PER_REQUEST,
    FittedImage,
    base64_size,
    budget,
    fit,
    newest_only,
)
from agentbox.store.images import DISCARD_GRACE_SECONDS, IMAGE_BLOBS_DIR_NAME, ImageNotFound, ImageStore
from agentbox.tools.base import ImageBlock, TextBlock
from tests.conftest import Server, start_server, stop_server
from tests.test_api_sessions import DEADLINE, frames
from tests.test_providers import Canned, Loopback, Received, anthropic_sse, delta, finish, openai_sse
from tests.test_runtime_e2e import loopback_model

# ------------------------------------------------------------------ images


def png(width: int, height: int, color: tuple[int, int, int] = (200, 30, 30), mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, (width, height), color if mode == "RGB" else 0).save(buffer, "PNG")
    return buffer.getvalue()


def noise_png(width: int, height: int) -> bytes:
    """A PNG that does not compress: random pixels."""
    buffer = io.BytesIO()
    Image.frombytes("RGB", (width, height), os.urandom(width * height * 3)).save(buffer, "PNG")
    return buffer.getvalue()


def padded_png(size: int) -> bytes:
    """A small PNG made exactly `size` bytes long by an uncompressed text chunk."""

    def build(pad: int) -> bytes:
        info = PngImagePlugin.PngInfo()
        info.add_text("pad", "x" * pad)
        buffer = io.BytesIO()
        Image.new("RGB", (8, 8), (1, 2, 3)).save(buffer, "PNG", pnginfo=info)
        return buffer.getvalue()

    data = build(0)
    data = build(size - len(data))
    assert len(data) == size
    return data


def block(data: bytes, media_type: str = "image/png") -> ImageBlock:
    return ImageBlock(media_type, base64.b64encode(data).decode())


def decoded(data: str | bytes) -> Image.Image:
    raw = base64.b64decode(data) if isinstance(data, str) else data
    return Image.open(io.BytesIO(raw))


# ------------------------------------------------------------------ the limits, at their boundaries


def test_an_image_within_every_limit_goes_as_it_is() -> None:
    data = png(MAX_IMAGE_EDGE_PX, 30)
    fitted = fit(block(data))
    assert isinstance(fitted, FittedImage)
    assert (fitted.data, fitted.media_type, fitted.width, fitted.height) == (data, "image/png", 2048, 30)


def test_an_image_one_pixel_over_the_edge_is_resized_to_it() -> None:
    fitted = fit(block(png(30, MAX_IMAGE_EDGE_PX + 1)))
    assert isinstance(fitted, FittedImage)
    assert (fitted.width, fitted.height) == (30, MAX_IMAGE_EDGE_PX)
    assert decoded(fitted.data).size == (30, MAX_IMAGE_EDGE_PX)


def test_the_byte_limit_counts_the_base64_the_model_receives() -> None:
    at_limit = padded_png(MAX_IMAGE_BYTES_TO_MODEL // 4 * 3)
    assert base64_size(len(at_limit)) == MAX_IMAGE_BYTES_TO_MODEL
    fitted = fit(block(at_limit))
    assert isinstance(fitted, FittedImage) and fitted.data == at_limit

    over = padded_png(MAX_IMAGE_BYTES_TO_MODEL // 4 * 3 + 1)
    fitted = fit(block(over))
    assert isinstance(fitted, FittedImage) and fitted.data != over
    assert base64_size(len(fitted.data)) <= MAX_IMAGE_BYTES_TO_MODEL
    assert decoded(fitted.data).size == (8, 8)


def test_an_image_too_large_as_png_is_re_encoded_until_it_fits() -> None:
    data = noise_png(1400, 1400)  # about 5.9 MB as PNG, 7.8 MB as base64
    assert base64_size(len(data)) > MAX_IMAGE_BYTES_TO_MODEL
    fitted = fit(block(data))
    assert isinstance(fitted, FittedImage)
    assert fitted.media_type == "image/jpeg" and base64_size(len(fitted.data)) <= MAX_IMAGE_BYTES_TO_MODEL
    assert decoded(fitted.data).size == (1400, 1400)


def test_pixels_are_counted_from_the_header_before_decoding() -> None:
    side = 5000
    at_limit = png(side, MAX_IMAGE_PIXELS // side, mode="1")
    fitted = fit(block(at_limit))
    assert isinstance(fitted, FittedImage) and max(fitted.width, fitted.height) == MAX_IMAGE_EDGE_PX
    over = png(side, MAX_IMAGE_PIXELS // side + 1, mode="1")
    refused = fit(block(over))
    assert isinstance(refused, str) and "MAX_IMAGE_PIXELS" in refused


def test_bytes_that_are_no_image_are_a_note_not_an_error() -> None:
    assert "cannot be decoded" in str(fit(block(b"\x89PNG\r\n\x1a\nnot really")))
    assert fit(ImageBlock("image/png", "%%%")) == "its data is not base64"


def test_a_type_a_provider_would_refuse_becomes_png() -> None:
    buffer = io.BytesIO()
    Image.new("RGB", (20, 10), (0, 0, 255)).save(buffer, "BMP")
    fitted = fit(block(buffer.getvalue(), "image/bmp"))
    assert isinstance(fitted, FittedImage) and fitted.media_type == "image/png"
    assert decoded(fitted.data).size == (20, 10)


def results(count: int, images_each: int) -> list[ChatMessage]:
    image = block(png(4, 4))
    calls = [ToolCall(f"c{i}", "read_file", {}) for i in range(count)]
    step = [ChatMessage("assistant", "", calls)]
    for i in range(count):
        parts = (TextBlock(f"result {i}"), *([image] * images_each))
        step.append(ChatMessage("tool", f"result {i}", tool_use_id=f"c{i}", parts=parts))
    return step


def images_in(messages: list[ChatMessage]) -> int:
    return sum(isinstance(p, ImageBlock) for m in messages for p in m.parts)


def test_a_step_carries_at_most_the_limit_of_images_and_notes_the_rest() -> None:
    assert images_in(budget(results(MAX_IMAGES_PER_MESSAGE, 1))) == MAX_IMAGES_PER_MESSAGE
    shown = budget(results(3, 3))  # 9 in one step, counted across its results
    assert images_in(shown) == MAX_IMAGES_PER_MESSAGE
    last = shown[-1]
    assert isinstance(last.parts[-1], TextBlock) and "MAX_IMAGES_PER_MESSAGE" in last.parts[-1].text
    assert "image 9 not shown" in last.text  # the text every adapter sends has the note too
    # the count starts again after each reply: two steps of 8 each keep all 16
    assert images_in(budget([*results(MAX_IMAGES_PER_MESSAGE, 1)] * 2)) == 2 * MAX_IMAGES_PER_MESSAGE


def test_a_request_carries_only_the_newest_images_of_the_transcript() -> None:
    def row(*ids: int) -> list[dict[str, object]]:
        return [{"type": "text", "text": "seen"}, *({"type": "image", "image_id": f"img_{i}"} for i in ids)]

    def images(rows: list[list[dict[str, object]] | None]) -> list[object]:
        return [b["image_id"] for r in rows if r for b in r if b["type"] == "image"]

    exactly = [row(*range(i, i + 4)) for i in range(0, MAX_IMAGES_PER_REQUEST, 4)]
    assert newest_only(exactly) == exactly  # at the limit nothing is touched
    over = [row(-1), None, *exactly]
    kept = newest_only(over)
    assert images(kept) == images(exactly) and kept[1] is None
    assert kept[0][1]["type"] == "text" and "MAX_IMAGES_PER_REQUEST" in str(kept[0][1]["text"])


def test_anthropic_tool_results_carry_their_images_and_the_note_in_order() -> None:
    wire = anthropic_messages(budget(results(1, MAX_IMAGES_PER_MESSAGE + 1)))
    content = wire[-1]["content"][0]["content"]
    assert content[0] == {"type": "text", "text": "result 0"}
    kinds = [b["type"] for b in content[1:]]
    assert kinds == ["image"] * MAX_IMAGES_PER_MESSAGE + ["text"]
    assert content[1]["source"]["type"] == "base64" and content[1]["source"]["media_type"] == "image/png"


async def test_the_image_store_is_content_addressed(tmp_path: Path) -> None:
    images = ImageStore(tmp_path)
    first = await images.put(b"picture")
    assert await images.put(b"picture") == first and first.startswith("img_")
    assert await images.get(first) == b"picture"
    assert len(list((tmp_path / IMAGE_BLOBS_DIR_NAME).rglob("*"))) == 2  # one folder, one blob
    with pytest.raises(ImageNotFound):
        await images.get("img_" + "0" * 64)
    with pytest.raises(ImageNotFound):
        await images.get("../../etc/passwd")


async def test_discard_removes_an_image_unless_it_was_just_stored_again(tmp_path: Path) -> None:
    images = ImageStore(tmp_path)
    old, fresh = await images.put(b"old picture"), await images.put(b"fresh picture")
    path = tmp_path / IMAGE_BLOBS_DIR_NAME / old[4:6] / old[4:]
    past = time.time() - DISCARD_GRACE_SECONDS - 1
    os.utime(path, (past, past))
    assert await images.discard([old, fresh, "../../etc/passwd"]) == 1
    with pytest.raises(ImageNotFound):
        await images.get(old)
    assert await images.get(fresh) == b"fresh picture"  # within the grace: another row may be coming
    again = await images.put(b"old picture")
    assert again == old and await images.discard([again]) == 0  # stored again: touched, kept


def test_vision_defaults_and_configuration() -> None:
    assert model_limits("openai:gpt-4o").vision and model_limits("anthropic:claude-new").vision
    assert not model_limits("openai:local-coder").vision  # an unknown OpenAI-compatible model
    assert not model_limits("openai:gpt-4o", configured={"vision": False}).vision
    assert model_limits("openai:local-coder", {"vision": True}).vision
    check_limit_options({"vision": False})
    with pytest.raises(LimitsError, match="vision must be true or false"):
        check_limit_options({"vision": "yes"})


# ------------------------------------------------------------------ the loopback models

#: The images the tests put in the workspace.
SMALL = png(64, 48)
WIDE = png(MAX_IMAGE_EDGE_PX + 1, 40, (10, 120, 200))
#: Reads in one step for the budget test.
MANY = MAX_IMAGES_PER_MESSAGE + 1
CHILD_PROMPT = "Child: describe small.png"


def prompt_of(messages: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """The last user prompt (not a signal, not an images message) and what came after it."""
    for at in range(len(messages) - 1, -1, -1):
        m = messages[at]
        if m["role"] == "user" and isinstance(m["content"], str) and not m["content"].startswith("<signal"):
            return m["content"], messages[at + 1 :]
    return "", []


def openai_calls(body: dict[str, Any], calls: list[tuple[str, dict[str, Any]]]) -> Canned:
    n = len(body["messages"])
    fragments = [
        {"index": i, "id": f"call_{n}_{i}", "type": "function",
         "function": {"name": name, "arguments": json.dumps(arguments)}}
        for i, (name, arguments) in enumerate(calls)
    ]  # fmt: skip
    usage = {"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": 5}}
    return Canned(body=openai_sse(delta(role="assistant", tool_calls=fragments), finish("tool_calls"), usage))


def openai_text(text: str) -> Canned:
    usage = {"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": 5}}
    return Canned(body=openai_sse(delta(role="assistant", content=text), finish("stop"), usage))


def gpt(request: Received) -> Canned:
    """Reads what its prompt names; once results came back, says so (a child does the same)."""
    prompt, after = prompt_of(request.json["messages"])
    if any(m["role"] == "tool" for m in after):
        return openai_text(f"seen: {prompt}")
    if prompt == "look at both":
        return openai_calls(
            request.json, [("read_file", {"path": "small.png"}), ("read_file", {"path": "wide.png"})]
        )
    if prompt == "look at many":
        return openai_calls(request.json, [("read_file", {"path": "small.png"})] * MANY)
    if prompt == "delegate":
        return openai_calls(
            request.json, [("task", {"agent": "explore", "prompt": CHILD_PROMPT, "description": "look"})]
        )
    if prompt == CHILD_PROMPT:
        return openai_calls(request.json, [("read_file", {"path": "small.png"})])
    if prompt == "look, then wait":
        return openai_calls(request.json, [("read_file", {"path": "small.png"})])
    return openai_text("nothing to do")


def claude(request: Received) -> Canned:
    messages = request.json["messages"]
    answered = any(b.get("type") == "tool_result" for b in messages[-1]["content"])
    events: list[dict[str, Any]] = [
        {"type": "message_start", "message": {"usage": {"input_tokens": 9, "output_tokens": 1}}}
    ]
    if answered:
        events += [
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "seen"}},
            {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 1}},
        ]
    else:
        events += [
            {"type": "content_block_start", "index": 0, "content_block": {"type": "tool_use", "id": "toolu_v", "name": "read_file", "input": {}}},
            {"type": "content_block_delta", "index": 0, "delta": {"type": "input_json_delta", "partial_json": '{"path": "wide.png"}'}},
            {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 4}},
        ]  # fmt: skip
    return Canned(body=anthropic_sse(*events, {"type": "message_stop"}))


@pytest.fixture
async def llm() -> AsyncIterator[Loopback]:
    async for loopback in loopback_model(gpt):
        yield loopback


@pytest.fixture
async def anthropic_llm() -> AsyncIterator[Loopback]:
    async for loopback in loopback_model(claude):
        yield loopback


#: A model the operator configured as text-only although its name is a known vision model's.
TEXT_ONLY = "openai:gpt-4o-text"


def serve(home_parent: Path, endpoints: list[str]) -> Server:
    home = home_parent / "home"
    home.mkdir(exist_ok=True)
    config = home_parent / "agentbox.toml"
    config.write_text(
        f"model_endpoints = {json.dumps(endpoints)}\n\n[models.{json.dumps(TEXT_ONLY)}]\nvision = false\n"
    )
    return start_server(home, {"AGENTBOX_CONFIG": str(config)})


@pytest.fixture
def served(sandbox_tmp: Path, llm: Loopback, anthropic_llm: Loopback) -> Iterator[Server]:
    started = serve(sandbox_tmp, [f"{llm.url}/v1", anthropic_llm.url])
    yield started
    stop_server(started)


async def session(client: httpx.AsyncClient, model: str, url: str, **extra: Any) -> str:
    options = {"base_url": url, "api_key": "k"}
    r = await client.post("/v1/sessions", json={"model": model, "model_options": options, **extra})
    assert r.status_code == 201, r.text
    sid = str(r.json()["id"])
    for name, data in (("small.png", SMALL), ("wide.png", WIDE)):
        body = {
            "file": f"/workspace/{name}",
            "content": base64.b64encode(data).decode(),
            "encoding": "base64",
        }
        r = await client.post(f"/sandboxes/{sid}/v1/file/write", json=body)
        assert r.status_code == 200 and r.json()["success"], r.text
    return sid


async def turn(
    client: httpx.AsyncClient, sid: str, content: str, after: str | None = None
) -> list[dict[str, Any]]:
    r = await client.post(f"/v1/sessions/{sid}/messages", json={"content": content})
    assert r.status_code == 202, r.text
    params = {"until": "turn_end", **({"after": after} if after else {})}
    streamed = await frames(client, sid, params=params)
    log = [
        f.data | {"_id": f.id}
        for f in streamed
        if f.data is not None and f.data.get("turn_id") == r.json()["turn_id"]
    ]
    assert log[-1]["type"] == "turn.completed", log[-1]
    return log


def openai_images(body: dict[str, Any]) -> list[Image.Image]:
    """Every image in a Chat Completions request, decoded from its data URL."""
    found = []
    for m in body["messages"]:
        if isinstance(m.get("content"), list):
            for part in m["content"]:
                if part["type"] == "image_url":
                    head, _, data = part["image_url"]["url"].partition(",")
                    assert head.startswith("data:image/") and head.endswith(";base64")
                    found.append(decoded(data))
    return found


# ------------------------------------------------------------------ end to end


async def test_openai_gets_the_images_after_the_tool_messages_resized_and_replayed_from_the_store(
    served: Server, llm: Loopback
) -> None:
    async with httpx.AsyncClient(base_url=served.url, timeout=DEADLINE) as client:
        sid = await session(client, "openai:gpt-4o", llm.url + "/v1")
        log = await turn(client, sid, "look at both")
        second = llm.requests[-1].json["messages"]
        roles = [m["role"] for m in second]
        assert roles[-4:] == ["assistant", "tool", "tool", "user"], roles
        assert all(isinstance(m["content"], str) for m in second[-3:-1])  # tool messages: text only
        small, wide = openai_images(llm.requests[-1].json)
        assert "read_image" in {t["function"]["name"] for t in llm.requests[-1].json["tools"]}
        assert small.size == (64, 48) and small.tobytes() == Image.open(io.BytesIO(SMALL)).tobytes()
        assert wide.size == (MAX_IMAGE_EDGE_PX, 40)  # 2049 px, resized to fit
        labels = [p["text"] for p in second[-1]["content"] if p["type"] == "text"]
        assert [label.rsplit(" ", 1)[-1] for label in labels] == [
            f"{m['tool_call_id']}:" for m in second[-3:-1]
        ]
        assert f"[image image/png {MAX_IMAGE_EDGE_PX}x40]" in second[-2]["content"]

        results = [e for e in log if e["type"] == "agent.tool_result"]
        images = [b for e in results for b in e["content"] if b["type"] == "image"]
        assert [(b["width"], b["height"]) for b in images] == [(64, 48), (MAX_IMAGE_EDGE_PX, 40)]
        assert images[0]["bytes"] == len(SMALL) and images[0]["media_type"] == "image/png"
        assert all(set(b) == {"type", "image_id", "media_type", "bytes", "width", "height"} for b in images)
        assert base64.b64encode(SMALL).decode() not in json.dumps(log)  # events name images, never carry them
        stored = served.home / IMAGE_BLOBS_DIR_NAME / images[0]["image_id"][4:6] / images[0]["image_id"][4:]
        assert stored.read_bytes() == SMALL
        got = await client.get(f"/v1/sessions/{sid}/images/{images[0]['image_id']}")
        assert got.status_code == 200 and got.content == SMALL and got.headers["content-type"] == "image/png"
        other = await session(client, "openai:gpt-4o", llm.url + "/v1")  # never saw it
        for where, image_id in ((other, images[0]["image_id"]), (sid, "img_" + "0" * 64), (sid, "../x")):
            refused = await client.get(f"/v1/sessions/{where}/images/{image_id}")
            assert refused.status_code == 404 and refused.json()["data"]["error_type"] == "not_found", refused.text
        await client.delete(f"/v1/sessions/{other}")

        await turn(client, sid, "again", after=log[-1]["_id"])
        replayed = openai_images(llm.requests[-1].json)  # the next turn, rebuilt from the rows
        assert [i.size for i in replayed] == [(64, 48), (MAX_IMAGE_EDGE_PX, 40)]
        assert replayed[1].tobytes() == wide.tobytes()
        await client.delete(f"/v1/sessions/{sid}")


async def test_anthropic_gets_images_inside_the_tool_result(served: Server, anthropic_llm: Loopback) -> None:
    async with httpx.AsyncClient(base_url=served.url, timeout=DEADLINE) as client:
        sid = await session(client, "anthropic:claude-test", anthropic_llm.url)
        log = await turn(client, sid, "look at the wide one")
        assert [e for e in log if e["type"] == "agent.message"][-1]["content"][0]["text"] == "seen"
        (result,) = anthropic_llm.requests[-1].json["messages"][-1]["content"]
        assert result["type"] == "tool_result" and result["tool_use_id"] == "toolu_v"
        text, image = result["content"]
        assert text["type"] == "text" and "wide.png" in text["text"]
        assert image["type"] == "image" and image["source"]["type"] == "base64"
        assert image["source"]["media_type"] == "image/png"
        assert decoded(image["source"]["data"]).size == (MAX_IMAGE_EDGE_PX, 40)
        await client.delete(f"/v1/sessions/{sid}")


async def test_nine_images_in_one_step_carry_eight_and_a_note(served: Server, llm: Loopback) -> None:
    async with httpx.AsyncClient(base_url=served.url, timeout=DEADLINE) as client:
        sid = await session(client, "openai:gpt-4o", llm.url + "/v1")
        await turn(client, sid, "look at many")
        body = llm.requests[-1].json
        assert len(openai_images(body)) == MAX_IMAGES_PER_MESSAGE
        tools = [m for m in body["messages"] if m["role"] == "tool"]
        assert len(tools) == MANY
        assert (
            "image 9 not shown" in tools[-1]["content"] and "MAX_IMAGES_PER_MESSAGE" in tools[-1]["content"]
        )
        assert not any("not shown" in m["content"] for m in tools[:-1])
        await client.delete(f"/v1/sessions/{sid}")


async def test_a_model_without_vision_is_told_why_it_sees_no_image(served: Server, llm: Loopback) -> None:
    async with httpx.AsyncClient(base_url=served.url, timeout=DEADLINE) as client:
        sid = await session(client, TEXT_ONLY, llm.url + "/v1")
        log = await turn(client, sid, "look at both")
        body = llm.requests[-1].json
        assert openai_images(body) == [] and body["messages"][-1]["role"] == "tool"
        why = f"visionUnavailable: the model {TEXT_ONLY} is configured without vision"
        tools = [m["content"] for m in body["messages"] if m["role"] == "tool"]
        assert len(tools) == 2 and all(why in t for t in tools)
        results = [e for e in log if e["type"] == "agent.tool_result"]
        assert all(why in e["content"][0]["text"] for e in results)
        assert not (served.home / IMAGE_BLOBS_DIR_NAME).exists()  # nothing kept for it
        offered = {t["function"]["name"] for t in body["tools"]}
        assert "read_file" in offered and "read_image" not in offered  # no tool only for looking
        await client.delete(f"/v1/sessions/{sid}")


async def test_a_subagent_sees_the_image_it_reads(served: Server, llm: Loopback) -> None:
    async with httpx.AsyncClient(base_url=served.url, timeout=DEADLINE) as client:
        sid = await session(client, "openai:gpt-4o", llm.url + "/v1")
        log = await turn(client, sid, "delegate")
        assert [e["status"] for e in log if e["type"] == "subagent.completed"] == ["completed"]
        child = [q.json for q in llm.requests if prompt_of(q.json["messages"])[0] == CHILD_PROMPT]
        assert len(child) == 2  # its read, then its answer with the image in front of it
        (image,) = openai_images(child[-1])
        assert image.size == (64, 48)
        assert child[-1]["messages"][-1]["role"] == "user"  # the images message after its tool message
        await client.delete(f"/v1/sessions/{sid}")


def resumes_the_child(request: Received) -> Canned:
    """`gpt`, and `resume <run id>` continues that child run with a question."""
    prompt, after = prompt_of(request.json["messages"])
    if prompt.startswith("resume ") and not any(m["role"] == "tool" for m in after):
        call = {"agent": "explore", "prompt": "Child: what did it show?", "resume": prompt.split()[1]}
        return openai_calls(request.json, [("task", call)])
    return gpt(request)


async def test_a_resumed_subagent_is_shown_the_image_its_run_read_before(served: Server, llm: Loopback) -> None:
    llm.respond = resumes_the_child
    async with httpx.AsyncClient(base_url=served.url, timeout=DEADLINE) as client:
        sid = await session(client, "openai:gpt-4o", llm.url + "/v1")
        log = await turn(client, sid, "delegate")
        (done,) = [e for e in log if e["type"] == "subagent.completed"]
        run_id = done["subagent_id"]
        stored = (await client.get(f"/v1/sessions/{sid}/subagents/{run_id}")).json()["messages"]
        (shown,) = [b for m in stored for b in m.get("blocks") or [] if b["type"] == "image"]
        assert (shown["width"], shown["height"]) == (64, 48)
        got = await client.get(f"/v1/sessions/{sid}/images/{shown['image_id']}")  # a child's image is the session's
        assert got.status_code == 200 and got.content == SMALL

        await turn(client, sid, f"resume {run_id}", after=log[-1]["_id"])
        resumed = [q.json for q in llm.requests if prompt_of(q.json["messages"])[0] == "Child: what did it show?"]
        assert len(resumed) == 1  # it answered at once, with the earlier read in front of it
        (image,) = openai_images(resumed[0])
        assert image.size == (64, 48) and image.tobytes() == Image.open(io.BytesIO(SMALL)).tobytes()
        await client.delete(f"/v1/sessions/{sid}")


def hang_after_reading(llm: Loopback) -> Callable[[Received], Canned]:
    """`gpt`, except that the answer to a result of `look, then wait` never comes (once)."""
    hung: list[bool] = []

    def respond(request: Received) -> Canned:
        prompt, after = prompt_of(request.json["messages"])
        if prompt == "look, then wait" and any(m["role"] == "tool" for m in after) and not hung:
            hung.append(True)
            return Canned(hang=True)
        return gpt(request)

    return respond


async def test_a_turn_resumed_after_a_crash_shows_the_image_again(sandbox_tmp: Path, llm: Loopback) -> None:
    llm.respond = hang_after_reading(llm)
    first = serve(sandbox_tmp, [f"{llm.url}/v1"])
    try:
        async with httpx.AsyncClient(base_url=first.url, timeout=DEADLINE) as client:
            sid = await session(client, "openai:gpt-4o", llm.url + "/v1")
            r = await client.post(f"/v1/sessions/{sid}/messages", json={"content": "look, then wait"})
            turn_id = r.json()["turn_id"]
            await frames(client, sid, stop=lambda f: f.event == "agent.tool_result")
            for _ in range(200):  # the model call after the result has started
                if len(llm.requests) >= 2:
                    break
                await asyncio.sleep(0.05)
            (before,) = openai_images(llm.requests[-1].json)
        first.process.kill()
        first.process.wait()
    finally:
        stop_server(first)
    again = serve(sandbox_tmp, [f"{llm.url}/v1"])
    try:
        async with httpx.AsyncClient(base_url=again.url, timeout=DEADLINE) as client:
            streamed = await frames(client, sid, params={"until": "turn_end"})
            ends = [
                f.data
                for f in streamed
                if f.data and f.data.get("turn_id") == turn_id and f.event == "turn.completed"
            ]
            assert ends, [f.event for f in streamed]
            (after,) = openai_images(llm.requests[-1].json)  # the resumed call, rebuilt from the store
            assert after.tobytes() == before.tobytes() and after.size == (64, 48)
    finally:
        stop_server(again)


def test_the_summarized_part_s_images_go_with_the_summary_request() -> None:
    old = [ChatMessage("user", "look"), *results(MAX_IMAGES_PER_MESSAGE + 2, 1)]
    old.append(ChatMessage("assistant", "seen"))
    (asked,) = summary_request(old).request.messages
    shown = [p for p in asked.parts if isinstance(p, ImageBlock)]
    assert len(shown) == MAX_IMAGES_PER_MESSAGE and asked.parts[0] == TextBlock(asked.text)
    assert "[Tool result]: result 9" in asked.text
    assert anthropic_messages([asked])[0]["content"][1]["type"] == "image"
    plain = summary_request([ChatMessage("user", "hi"), ChatMessage("assistant", "hello")])
    assert plain.request.messages[0].parts == ()


def test_an_image_counts_in_the_token_estimate() -> None:
    (_, result) = results(1, 2)
    assert estimate_tokens(result) == estimate_tokens(ChatMessage("tool", result.text)) + 2 * IMAGE_TOKENS
