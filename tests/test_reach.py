"""`agentbox.agent.reach` and the provider endpoint's key rule, against real loopback servers.

The session-level behaviour (refusals at creation, no server key on the wire) is in
tests/adversarial/test_session_supplied.py; here are the pieces at their boundaries.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from agentbox.agent.providers import OpenAIModel
from agentbox.agent.providers.endpoint import endpoint
from agentbox.agent.providers.errors import EndpointRefused
from agentbox.agent.reach import Pin, Reach, Unreachable, own_address, under
from tests.test_providers import Loopback, request
from tests.test_runtime_e2e import loopback_model, text_reply


@pytest.fixture
async def llm() -> AsyncIterator[Loopback]:
    async for model in loopback_model(lambda received: text_reply(received.json, "hi")):
        yield model


def test_a_listed_prefix_covers_its_endpoint_and_below_only() -> None:
    prefix = "http://127.0.0.1:11434/v1"
    assert under(httpx.URL("http://127.0.0.1:11434/v1"), prefix)
    assert under(httpx.URL("http://127.0.0.1:11434/v1/chat/completions"), prefix)
    for other in (
        "http://127.0.0.1:11434/v10/chat",  # a longer path segment is not below /v1
        "http://127.0.0.1:11435/v1",  # another port
        "https://127.0.0.1:11434/v1",  # another scheme
        "http://127.0.0.2:11434/v1",  # another host
        "http://127.0.0.1:11434/",
    ):
        assert not under(httpx.URL(other), prefix), other
    assert under(httpx.URL("http://localhost/x"), "http://LOCALHOST:80")  # default port, host case


def test_the_hosts_own_addresses_are_recognised() -> None:
    assert own_address("127.0.0.1")
    assert not own_address("192.0.2.1")  # TEST-NET-1: never assigned here


async def test_the_policy_refuses_before_any_connection() -> None:
    with pytest.raises(Unreachable, match="http or https"):
        Reach().check("file:///etc/passwd", "base_url")
    with pytest.raises(Unreachable, match="no network"):
        Reach(network=False).check("https://example.com/v1", "base_url")
    with pytest.raises(Unreachable, match="non-public"):
        await Reach().pin("http://127.0.0.1:9/v1", "base_url")
    with pytest.raises(Unreachable, match="non-public"):
        await Reach().pin("http://[::1]:9/v1", "base_url")
    with pytest.raises(Unreachable, match="non-public"):
        await Reach().pin("http://169.254.169.254/latest", "base_url")  # link-local: cloud metadata
    listed = Reach(network=False, allowed=("http://127.0.0.1:9/v1",))
    assert await listed.pin("http://127.0.0.1:9/v1/chat", "base_url") == Pin("127.0.0.1", "127.0.0.1")


async def test_a_pinned_request_goes_to_the_checked_address_whatever_the_name(llm: Loopback) -> None:
    """The name never resolves (`.invalid`); the request still reaches the checked address,
    with the name kept in the Host header: a later DNS answer has nothing to switch."""
    port = llm.url.rsplit(":", 1)[1]
    pin = Pin("model.invalid", "127.0.0.1")
    async with httpx.AsyncClient(
        transport=pin.transport(httpx.AsyncHTTPTransport()), trust_env=False
    ) as client:  # type: ignore[arg-type]
        r = await client.post(f"http://model.invalid:{port}/v1/chat/completions", json={"messages": []})
        assert r.status_code == 200
        with pytest.raises(Unreachable, match=r"only model\.invalid"):
            await client.get(f"http://elsewhere.invalid:{port}/")
    (sent,) = llm.requests
    assert sent.headers["host"] == f"model.invalid:{port}"


def test_the_server_key_goes_only_to_the_operators_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-server")
    monkeypatch.setenv("OPENAI_BASE_URL", "http://gateway.internal/v1/")
    kw = {"env_prefix": "OPENAI", "default_base_url": "https://api.openai.com/v1", "path": "/chat"}
    assert endpoint({}, **kw).api_key == "sk-server"
    assert endpoint({"base_url": "http://gateway.internal/v1"}, **kw).api_key == "sk-server"  # the same one
    own = endpoint(
        {"base_url": "https://api.openai.com/v1"}, **kw, reach=Reach()
    )  # not the env's: a session's
    assert own.api_key == "" and own.reach == Reach()
    assert endpoint({"base_url": "http://evil.example/v1", "api_key": "sk-own"}, **kw).api_key == "sk-own"
    assert endpoint({}, **kw, reach=Reach()).reach is None  # the operator's endpoint is not checked


async def test_a_refused_base_url_fails_the_call_and_sends_nothing(
    llm: Loopback, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-server")
    refused = OpenAIModel("m", {"base_url": llm.url + "/v1"}, Reach())
    with pytest.raises(EndpointRefused, match="non-public"):
        await refused.query(request())
    assert llm.requests == []
    listed = OpenAIModel("m", {"base_url": llm.url + "/v1"}, Reach(allowed=(llm.url + "/v1",)))
    reply = await listed.query(request())
    assert reply.text == "hi"
    (sent,) = llm.requests
    assert "authorization" not in sent.headers  # listed is reachable, not trusted with the key
