"""Raw HTTP checks: bad Connect input, unknown routes, /init, /envs,
/metrics, and the access token (last: it changes the agent's state)."""

import json
import urllib.parse

import pytest
from e2b import Sandbox
from e2b.exceptions import AuthenticationException

from conftest import connect_frames, envelope, http, sandbox_with_token

STREAM = {"Content-Type": "application/connect+json"}
UNARY = {"Content-Type": "application/json"}


def test_health():
    assert http("GET", "/health")[0] == 204


def test_start_streams_frames_in_order():
    body = envelope({"process": {"cmd": "/bin/echo", "args": ["raw"]}})
    status, headers, resp = http("POST", "/process.Process/Start", body, STREAM)
    assert status == 200
    assert headers["content-type"] == "application/connect+json"
    frames = connect_frames(resp)
    assert "start" in frames[0][1]["event"]
    assert frames[1][1]["event"]["data"]["stdout"] == "cmF3Cg=="  # "raw\n"
    end = frames[-2][1]["event"]["end"]
    assert end["exited"] is True and end["status"] == "exit status 0"
    assert frames[-1] == (2, {})


def test_truncated_envelope_is_invalid_argument():
    body = envelope({"process": {"cmd": "/bin/true"}})[:-3]
    status, _, resp = http("POST", "/process.Process/Start", body, STREAM)
    assert status == 200
    (flags, end), = connect_frames(resp)
    assert flags == 2 and end["error"]["code"] == "invalid_argument"


def test_oversized_envelope_is_refused():
    body = bytes([0]) + (1 << 30).to_bytes(4, "big") + b"{}"
    status, _, resp = http("POST", "/process.Process/Start", body, STREAM)
    (flags, end), = connect_frames(resp)
    assert end["error"]["code"] == "invalid_argument"


def test_invalid_json_unary():
    status, _, resp = http("POST", "/filesystem.Filesystem/Stat", b"{not json", UNARY)
    assert status == 400
    assert json.loads(resp)["code"] == "invalid_argument"


def test_unknown_method_and_service():
    for path in ("/process.Process/Nope", "/nope.Service/Stat"):
        status, _, resp = http("POST", path, b"{}", UNARY)
        assert status == 404
        assert json.loads(resp)["code"] == "unimplemented"


def test_binary_protobuf_stat():
    # StatRequest{path: "/"} in binary protobuf.
    status, headers, resp = http("POST", "/filesystem.Filesystem/Stat", b"\x0a\x01/", {"Content-Type": "application/proto"})
    assert status == 200 and headers["content-type"] == "application/proto"
    assert b"FILE_TYPE" not in resp and resp.startswith(b"\x0a")  # StatResponse.entry, binary
    status, _, _ = http("POST", "/filesystem.Filesystem/Stat", b"\x0a\x01/", {"Content-Type": "application/xml"})
    assert status == 415


def test_not_found_codes():
    status, _, resp = http("POST", "/filesystem.Filesystem/Stat", json.dumps({"path": "/nonexistent-tine"}).encode(), UNARY)
    assert status == 404 and json.loads(resp)["code"] == "not_found"
    status, _, resp = http("POST", "/process.Process/SendSignal", json.dumps({"process": {"pid": 999999}, "signal": "SIGNAL_SIGKILL"}).encode(), UNARY)
    assert status == 404 and json.loads(resp)["code"] == "not_found"


def test_unknown_user_is_unauthenticated():
    hdr = {**UNARY, "Authorization": "Basic bm8tc3VjaC11c2VyOg=="}  # "no-such-user:"
    status, _, resp = http("POST", "/filesystem.Filesystem/Stat", json.dumps({"path": "/"}).encode(), hdr)
    assert status == 401 and json.loads(resp)["code"] == "unauthenticated"
    status, _, resp = http("GET", "/files?path=/etc/hostname&username=no-such-user")
    assert status == 401 and json.loads(resp)["code"] == 401


def test_files_errors_are_json():
    status, _, resp = http("GET", "/files?path=/nonexistent-tine")
    assert status == 404 and json.loads(resp)["code"] == 404
    status, _, resp = http("GET", "/files")
    assert status == 400 and json.loads(resp)["code"] == 400
    status, _, resp = http("POST", "/files?path=/tmp/x", b"data", {"Content-Type": "text/plain"})
    assert status == 400
    status, _, resp = http("POST", "/files?path=/tmp/tine-e2e-bad.gz", b"not gzip", {"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"})
    assert status == 400
    status, _, resp = http("GET", "/no-such-route")
    assert status == 404 and json.loads(resp)["code"] == 404


def test_metrics_and_init_envs():
    status, _, resp = http("GET", "/metrics")
    m = json.loads(resp)
    assert status == 200 and m["cpu_count"] >= 1 and m["mem_total"] > 0 and m["disk_total"] > 0
    body = json.dumps({"envVars": {"TINE_E2E_VAR": "from-init"}}).encode()
    assert http("POST", "/init", body, UNARY)[0] == 204
    assert json.loads(http("GET", "/envs")[2])["TINE_E2E_VAR"] == "from-init"
    assert Sandbox.create().commands.run("echo $TINE_E2E_VAR").stdout == "from-init\n"
    assert http("POST", "/init", b"{bad", UNARY)[0] == 400


def test_access_token_required_and_enforced():
    token = "tine-e2e-secret-token"
    assert http("POST", "/init", json.dumps({"accessToken": token}).encode(), UNARY)[0] == 204
    try:
        # Without the token: every SDK call is refused...
        plain = Sandbox.create()
        with pytest.raises(AuthenticationException):
            plain.commands.run("echo hi")
        with pytest.raises(AuthenticationException):
            plain.files.read("/etc/hostname")
        with pytest.raises(AuthenticationException):
            plain.files.list("/")
        status, _, resp = http("GET", "/envs")
        assert status == 401 and json.loads(resp)["code"] == 401
        status, _, _ = http("POST", "/process.Process/List", b"{}", {**UNARY, "X-Access-Token": "wrong"})
        assert status == 401
        # ...health stays open...
        assert http("GET", "/health")[0] == 204
        # ...and with it everything works.
        sbx = sandbox_with_token(token)
        assert sbx.commands.run("echo hi").stdout == "hi\n"
        sbx.files.write("/tmp/tine-e2e-token.txt", "t")
        assert sbx.files.read("/tmp/tine-e2e-token.txt") == "t"
        # Signed URLs work without the header; a tampered one does not.
        url = sbx.download_url("/tmp/tine-e2e-token.txt")
        parsed = urllib.parse.urlsplit(url)
        status, _, got = http("GET", f"{parsed.path}?{parsed.query}")
        assert status == 200 and got == b"t"
        status, _, _ = http("GET", f"{parsed.path}?{parsed.query}".replace("signature=v1_", "signature=v1_x"))
        assert status == 401
        url = sbx.download_url("/tmp/tine-e2e-token.txt", use_signature_expiration=60)
        parsed = urllib.parse.urlsplit(url)
        assert http("GET", f"{parsed.path}?{parsed.query}")[0] == 200
        # A signed upload URL takes a raw POST without the header.
        up = urllib.parse.urlsplit(sbx.upload_url("/tmp/tine-e2e-signed-up.txt"))
        status, _, resp = http("POST", f"{up.path}?{up.query}", b"up!", {"Content-Type": "application/octet-stream"})
        assert status == 200, resp
        assert sbx.files.read("/tmp/tine-e2e-signed-up.txt") == "up!"
        assert sbx.files.get_info("/tmp/tine-e2e-signed-up.txt").owner == "user"
        sbx.files.remove("/tmp/tine-e2e-signed-up.txt")
        # A read signature does not allow a write.
        status, _, _ = http("POST", f"{parsed.path}?{parsed.query}", b"x", {"Content-Type": "application/octet-stream"})
        assert status == 401
        sbx.files.remove("/tmp/tine-e2e-token.txt")
    finally:
        # Clearing the token needs the token itself.
        assert http("POST", "/init", json.dumps({"accessToken": ""}).encode(), UNARY)[0] == 401
        assert http("POST", "/init", json.dumps({"accessToken": ""}).encode(), {**UNARY, "X-Access-Token": token})[0] == 204
    assert http("GET", "/envs")[0] == 200
