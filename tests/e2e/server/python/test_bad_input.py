"""Bad input over raw HTTP: each gets the right status and the E2B error
body {"code": <status>, "message": "..."}; the server stays up."""

import json
import os
import re
import subprocess

import pytest

from conftest import RUN, assert_error, http, tagged

BAD = tagged({"group": "bad-input"})
MAX_BODY = int(os.environ.get("TINE_E2E_MAX_BODY", "65536"))
RPC_LIST = "/process.Process/List"


def create(body, **kw):
    return http("POST", "/v2/sandboxes", body=body, **kw)


@pytest.mark.parametrize("path", ["/v2/sandboxes", "/sandboxes"])
def test_no_key_is_401(path):
    assert_error(http("GET", path, key=None), 401)
    assert_error(create({"templateID": "base", "metadata": BAD}, key=None), 401)


def test_wrong_key_is_401():
    assert_error(http("GET", "/v2/sandboxes", key="e2b_" + "0" * 40), 401)
    assert_error(http("GET", "/sandboxes/whatever", key="not-a-key"), 401)
    assert_error(http("GET", "/v2/sandboxes", key=""), 401)
    assert_error(create({"templateID": "base", "metadata": BAD}, key="wrong"), 401)


def test_revoked_key_is_401():
    tine = os.environ.get("TINE_BIN")
    if not tine:
        pytest.skip("TINE_BIN not set")
    p = subprocess.run([tine, "keys", "create", "--name", f"e2e-revoke-{RUN}"], capture_output=True, text=True, check=True)
    key = p.stdout.strip()
    key_id = re.search(r"created key (\S+)", p.stderr).group(1)
    assert http("GET", "/v2/sandboxes?limit=1", key=key)[0] == 200
    subprocess.run([tine, "keys", "revoke", key_id], capture_output=True, check=True)
    assert_error(http("GET", "/v2/sandboxes?limit=1", key=key), 401)


def test_unknown_sandbox_is_404():
    sid = "nosuchsandbox0000000"
    assert_error(http("GET", f"/sandboxes/{sid}"), 404)
    assert_error(http("DELETE", f"/sandboxes/{sid}"), 404)
    assert_error(http("POST", f"/sandboxes/{sid}/timeout", body={"timeout": 30}), 404)
    assert_error(http("GET", f"/sandboxes/{sid}/metrics"), 404)
    assert_error(http("POST", f"/sandboxes/{sid}/refreshes", body={"duration": 30}), 404)


def test_unknown_template_is_404():
    assert_error(create({"templateID": "no-such-template-xyz", "metadata": BAD}), 404)


@pytest.mark.parametrize(
    "raw",
    [b"{", b"not json", b'{"templateID": "base",}', b"[1, 2]", b'{"templateID": 5}', b'{"metadata": "x"}'],
)
def test_malformed_json_is_400(raw):
    assert_error(create(raw, headers={"Content-Type": "application/json"}), 400)


@pytest.mark.parametrize(
    "extra",
    [
        {"cpuCount": 100000},
        {"cpuCount": 0},
        {"cpuCount": -1},
        {"memoryMB": 10**9},
        {"memoryMB": 1},
        {"memoryMB": -256},
        {"memoryMB": 10**20},
        {"timeout": -1},
        {"timeout": 10**12},
    ],
)
def test_absurd_values_are_400(extra):
    assert_error(create({"templateID": "base", "metadata": BAD, **extra}), 400)


def test_negative_timeout_on_a_sandbox_is_400(sbx):
    assert_error(http("POST", f"/sandboxes/{sbx.sandbox_id}/timeout", body={"timeout": -5}), 400)
    assert_error(http("POST", f"/sandboxes/{sbx.sandbox_id}/timeout", body=b"{oops"), 400)
    # Still alive and unchanged by the rejected calls.
    assert sbx.commands.run("true").exit_code == 0


@pytest.mark.parametrize("path", [
    "/v2/sandboxes?limit=abc",
    "/v2/sandboxes?state=running&state=paused",
    "/sandboxes?limit=-1",
    "/snapshots?limit=-1",
    "/templates/base/builds/x/status?logsOffset=abc",
    "/templates/%FF/tags",
    "/templates/%FF",
])
def test_bad_query_strings_and_paths_are_400_in_the_e2b_shape(path):
    assert_error(http("GET", path), 400)


def test_bad_query_on_a_sandbox_route_is_400(sbx):
    assert_error(http("GET", f"/sandboxes/{sbx.sandbox_id}/logs?start=abc"), 400)


def test_extreme_metrics_bounds_do_not_crash(sbx):
    # (Found by the fuzzer: i64::MIN made the handler panic.)
    lo = -(2**63)
    code, _, body = http("GET", f"/sandboxes/{sbx.sandbox_id}/metrics?start={lo}&end={lo}")
    assert code == 200, body[:300]


def test_a_template_registered_but_never_built_can_be_deleted():
    name = f"e2e-never-built-{RUN}"
    code, _, body = http("POST", "/v3/templates", {"name": name, "cpuCount": 1, "memoryMB": 256})
    assert code == 202, body
    assert http("GET", f"/templates/{name}")[0] == 200
    code, _, body = http("DELETE", f"/templates/{name}")
    assert code == 204, body
    assert_error(http("GET", f"/templates/{name}"), 404)
    assert_error(http("DELETE", f"/templates/{name}"), 404)


def test_body_over_max_body_bytes_is_413():
    big = {"templateID": "base", "metadata": {**BAD, "pad": "x" * (MAX_BODY + 1024)}}
    assert_error(create(big), 413)


def test_unknown_route_is_404():
    assert_error(http("GET", "/no/such/route"), 404)
    assert_error(http("GET", "/v3/sandboxes"), 404)
    assert_error(http("POST", "/sandboxes/x/y/z", body={}), 404)


def test_no_sandbox_was_made_by_bad_input():
    meta = "&".join(f"{k}={v}" for k, v in BAD.items())
    status, _, body = http("GET", "/v2/sandboxes?metadata=" + json_quote(meta) + "&state=running,paused")
    assert status == 200
    assert json.loads(body) == []


def json_quote(s):
    from urllib.parse import quote

    return quote(s, safe="")


# ---- sandbox traffic through the proxy ----


def proxied(sid, path=RPC_LIST, token=None, method="POST", body=b"{}", headers=None):
    h = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983", "Content-Type": "application/json", **(headers or {})}
    if token is not None:
        h["X-Access-Token"] = token
    return http(method, path, body=body if method == "POST" else None, headers=h, key=None)


def test_envd_with_the_right_token_works(sbx):
    status, _, body = proxied(sbx.sandbox_id, token=sbx._envd_access_token)
    assert status == 200, body[:300]
    assert "processes" in json.loads(body)


def test_envd_without_or_with_a_wrong_token_is_401(sbx):
    for token in (None, "", "wrong", sbx._envd_access_token + "x"):
        status, _, body = proxied(sbx.sandbox_id, token=token)
        assert status == 401, (token, status, body[:300])
        doc = json.loads(body)
        assert isinstance(doc.get("message"), str)
    # /files too (a plain HTTP route of the agent): the E2B error shape.
    for token in (None, "wrong"):
        assert_error(proxied(sbx.sandbox_id, path="/files?path=/etc/hostname", token=token, method="GET"), 401)
    # Another sandbox's token is no good either: it is per sandbox.
    status, _, _ = proxied(sbx.sandbox_id, path="/files?path=/etc/hostname", token="0" * 48, method="GET")
    assert status == 401


def test_envd_for_an_unknown_sandbox_is_502_not_found(sbx):
    for path, method in ((RPC_LIST, "POST"), ("/files?path=/etc/hostname", "GET"), ("/health", "GET")):
        status, _, body = proxied("nosuchsandbox0000000", path=path, token=sbx._envd_access_token, method=method)
        assert status == 502, (path, status, body[:300])
        assert "was not found" in json.loads(body)["message"]
    # Host routing too.
    status, _, body = http("GET", "/", headers={"Host": f"8000-nosuchsandbox0000000.localhost:{os.environ['TINE_E2E_PORT']}"}, key=None)
    assert status == 502, body[:300]
    assert "was not found" in json.loads(body)["message"]


def test_prometheus_metrics_count_what_happened(sbx):
    status, headers, body = http("GET", "/metrics", key=None)
    assert status == 200
    text = body.decode()
    assert headers["content-type"].startswith("text/plain")
    # Sandboxes by state: at least the shared one is running.
    running = [l for l in text.splitlines() if l.startswith("tine_sandboxes") and 'state="running"' in l]
    assert running and float(running[0].split()[-1]) >= 1, running
    # The 401s and 404s above were recorded by route and status.
    assert 'status="401"' in text and 'status="404"' in text
    assert "tine_api_request_duration_seconds" in text
    assert "tine_proxy_bytes" in text


def test_server_still_healthy():
    status, _, _ = http("GET", "/health", key=None)
    assert 200 <= status < 300
