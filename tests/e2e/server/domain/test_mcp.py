"""MCP in domain mode: Sandbox.create(mcp={...}) starts the template
`mcp-gateway` (scripts/build-mcp-gateway.sh builds it into the server's
data dir) and runs `mcp-gateway --config` in it; the official MCP client
(`mcp` from PyPI) reaches get_mcp_url() (https://50005-<id>.D/mcp) with
get_mcp_token().

Skipped with an SDK that has no `mcp` (2.0.0) or where the `mcp` package
is not installed (tests/e2e/setup.sh puts it in the newest SDK's venv)."""

import asyncio
import os
import ssl

import pytest
from e2b import Sandbox

if not hasattr(Sandbox, "get_mcp_url"):
    pytest.skip("this SDK version has no Sandbox.create(mcp=...)", allow_module_level=True)
mcp = pytest.importorskip("mcp", reason="the MCP client (mcp from PyPI) is not installed")
httpx2 = pytest.importorskip("httpx2")
from mcp.client.streamable_http import streamable_http_client  # noqa: E402
from e2b import SandboxException  # noqa: E402

TAG = {"tine-e2e": "mcp"}


def tls():
    return ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])


@pytest.fixture(scope="module")
def sbx():
    s = Sandbox.create(mcp={"time": {}, "memory": {}}, metadata=TAG, timeout=600)
    yield s
    Sandbox.kill(s.sandbox_id)


def with_client(sbx, action):
    """Run `action(client)` in a session of the official MCP client."""

    async def go():
        http = httpx2.AsyncClient(
            headers={"Authorization": f"Bearer {sbx.get_mcp_token()}"}, verify=tls(), timeout=60
        )
        async with http, mcp.Client(streamable_http_client(sbx.get_mcp_url(), http_client=http)) as c:
            return await action(c)

    return asyncio.run(go())


def test_url_and_token(sbx):
    assert sbx.get_mcp_url() == f"https://50005-{sbx.sandbox_id}.{os.environ['E2B_DOMAIN']}/mcp"
    token = sbx.get_mcp_token()
    assert token
    # The gateway keeps it where get_mcp_token() reads it without a cache.
    assert sbx.files.read("/etc/mcp-gateway/.token", user="root") == token


def test_tools_of_both_servers_listed_and_called(sbx):
    async def action(c):
        tools = {t.name for t in (await c.list_tools()).tools}
        called = await c.call_tool("get_current_time", {"timezone": "UTC"})
        return tools, called

    tools, called = with_client(sbx, action)
    assert {"get_current_time", "convert_time", "read_graph", "create_entities"} <= tools, tools
    assert not called.is_error, called
    assert '"timezone": "UTC"' in called.content[0].text, called


def test_resources_of_the_memory_server(sbx):
    async def action(c):
        listed = [str(r.uri) for r in (await c.list_resources()).resources]
        read = await c.read_resource("memory://knowledge-graph")
        return listed, read

    listed, read = with_client(sbx, action)
    assert "memory://knowledge-graph" in listed, listed
    assert '"entities"' in read.contents[0].text, read


@pytest.mark.parametrize("auth", ["Bearer not-the-token", None])
def test_a_wrong_or_missing_token_is_401(sbx, auth):
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    if auth:
        headers["Authorization"] = auth
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    with httpx2.Client(verify=tls(), timeout=60) as http:
        r = http.post(sbx.get_mcp_url(), json=body, headers=headers)
    assert r.status_code == 401, (r.status_code, r.text)
    assert r.headers["www-authenticate"] == 'Bearer realm="MCP Gateway"'


def test_an_unknown_server_fails_the_create_and_leaves_no_sandbox():
    tag = {"tine-e2e": "mcp-unknown"}
    with pytest.raises(SandboxException) as e:
        Sandbox.create(mcp={"time": {}, "nosuch": {}}, metadata=tag, timeout=120)
    msg = str(e.value)
    assert "Failed to start MCP gateway" in msg and '"nosuch"' in msg, msg
    left = [s for s in Sandbox.list(limit=100).next_items() if s.metadata == tag]
    assert left == [], left
