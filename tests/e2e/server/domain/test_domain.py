"""Domain mode over HTTPS (`tine serve --domain D --tls`): the SDK gets only
E2B_DOMAIN, E2B_API_KEY and tine's CA (SSL_CERT_FILE), and reaches the API
at https://api.D and sandboxes at https://<port>-<id>.D, as it reaches E2B.
Names under D (tine.localhost) resolve to loopback through nss-myhostname
(tests/e2e/setup.sh).

run.sh runs this file with the newest SDK and with the oldest 2.x (2.0.0),
which has no other way to reach a server than this one: it reads neither
E2B_API_URL nor E2B_SANDBOX_URL. Calls an SDK version lacks are skipped
with the reason."""

import os
import ssl
import threading
import time
import urllib.error
import urllib.request
from datetime import datetime, timedelta, timezone
from importlib.metadata import version

import pytest
from e2b import Sandbox

DOMAIN = os.environ["E2B_DOMAIN"]
SDK = version("e2b")
for var in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_DEBUG"):
    assert not os.environ.get(var), f"{var} must be unset in domain mode"


def get(url, method="GET", body=None, headers=None):
    ctx = ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60, context=ctx) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture(scope="module")
def sbx():
    s = Sandbox.create(metadata={"tine-e2e": "domain"}, timeout=600)
    yield s
    Sandbox.kill(s.sandbox_id)


def pause(s):
    """pause() (2.x later) or beta_pause() (2.0)."""
    return s.pause() if hasattr(s, "pause") else s.beta_pause()


def test_commands_and_files(sbx):
    assert sbx.commands.run("echo over-tls").stdout == "over-tls\n"
    sbx.files.write("/tmp/d.txt", "domain")
    assert sbx.files.read("/tmp/d.txt") == "domain"
    assert "d.txt" in [e.name for e in sbx.files.list("/tmp")]
    sbx.files.remove("/tmp/d-never-existed.txt")
    sbx.files.remove("/tmp/d.txt")
    assert not sbx.files.exists("/tmp/d.txt")


def test_signed_urls(sbx):
    sbx.files.write("/tmp/s.txt", "signed")
    url = sbx.download_url("/tmp/s.txt", use_signature_expiration=60)
    assert url.startswith(f"https://49983-{sbx.sandbox_id}.{DOMAIN}/"), url
    assert get(url) == (200, b"signed")
    status, body = get(sbx.download_url("/tmp/s.txt", use_signature_expiration=-10))
    assert status == 401 and b"signature is already expired" in body
    up = sbx.upload_url("/tmp/up.txt")
    form = (
        b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"up.txt\"\r\n\r\n"
        b"uploaded\r\n--b--\r\n"
    )
    status, _ = get(up, "POST", form, {"Content-Type": "multipart/form-data; boundary=b"})
    assert status == 200
    assert sbx.files.read("/tmp/up.txt") == "uploaded"


def test_get_host_over_https(sbx):
    sbx.commands.run("mkdir -p /tmp/www && echo hello-tls > /tmp/www/index.html")
    srv = sbx.commands.run("cd /tmp/www && exec python3 -m http.server 8000", background=True)
    try:
        host = sbx.get_host(8000)
        assert host == f"8000-{sbx.sandbox_id}.{DOMAIN}"
        got = None
        for _ in range(100):
            got = get(f"https://{host}/index.html")
            if got[0] == 200:
                break
            time.sleep(0.1)
        assert got == (200, b"hello-tls\n")
    finally:
        srv.kill()


def test_list_and_metrics(sbx):
    page = Sandbox.list(limit=100).next_items()
    assert sbx.sandbox_id in [i.sandbox_id for i in page]
    started = sbx.get_info().started_at
    samples = []
    for _ in range(30):
        samples = sbx.get_metrics(start=started - timedelta(seconds=1), end=datetime.now(timezone.utc))
        if samples:
            break
        time.sleep(1)
    assert samples, f"e2b {SDK}: no metrics in the sandbox's lifetime"
    before = started - timedelta(days=1)
    assert sbx.get_metrics(start=before, end=before + timedelta(hours=1)) == []


def test_pause_and_connect_resume():
    s = Sandbox.create(metadata={"tine-e2e": "domain"})
    try:
        s.files.write("/tmp/kept.txt", "kept")
        pause(s)
        assert s.get_info().state.value == "paused"
        back = Sandbox.connect(s.sandbox_id)
        assert back.get_info().state.value == "running"
        assert back.files.read("/tmp/kept.txt") == "kept"
    finally:
        Sandbox.kill(s.sandbox_id)


def test_a_killed_sandbox_ends_its_command_stream():
    s = Sandbox.create(metadata={"tine-e2e": "domain"})
    h = s.commands.run("sleep 300", background=True)
    threading.Timer(1.0, lambda: Sandbox.kill(s.sandbox_id)).start()
    with pytest.raises(Exception) as err:
        h.wait()
    # 2.0 calls it a timeout ("likely due to sandbox timeout"); later
    # versions: "killed or reached its end of life" / "was not found".
    text = str(err.value)
    assert any(w in text for w in ("killed", "not found", "sandbox timeout")), text
