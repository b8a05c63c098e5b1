"""E2B behaviours the SDKs rely on (issue 14): key format, signed URLs
without a sandbox id, killed streams, pause without memory, auto-resume,
metrics over time, listing order and filters, connect routing.

Runs against every SDK version .ci/run installs; calls a version lacks are
skipped with the reason."""

import inspect
import json
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime, timedelta, timezone

import pytest
from e2b import Sandbox

import e2b.exceptions as e2b_exceptions
from conftest import API_KEY, http, new_sandbox

SDK_VERSION = getattr(__import__("e2b"), "__version__", "?")


def fetch(url, method="GET", body=None, headers=None):
    """A plain request to a URL the SDK built: (status, body bytes)."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def supports(fn, param):
    return param in inspect.signature(fn).parameters


def wait_state(sandbox_id, state, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, _, body = http("GET", f"/sandboxes/{sandbox_id}")
        if status == 200 and json.loads(body)["state"] == state:
            return
        time.sleep(0.5)
    raise AssertionError(f"{sandbox_id} never became {state}")


def test_new_keys_have_e2bs_shape():
    # Some SDK versions refuse any other shape before sending a request.
    assert re.fullmatch(r"e2b_[0-9a-f]{40}", API_KEY), API_KEY[:8]


def test_signed_urls_name_no_sandbox_and_still_reach_it(sbx):
    sbx.files.write("/tmp/tine-e2e-signed.txt", "signed!")
    url = sbx.download_url("/tmp/tine-e2e-signed.txt")
    assert "signature=" in url and sbx.sandbox_id not in url.split("?")[0]
    assert fetch(url) == (200, b"signed!")
    assert fetch(sbx.download_url("/tmp/tine-e2e-signed.txt", use_signature_expiration=60)) == (200, b"signed!")

    status, body = fetch(sbx.download_url("/tmp/tine-e2e-signed.txt", use_signature_expiration=-10))
    assert status == 401
    assert json.loads(body) == {"code": 401, "message": "signature is already expired"}

    status, body = fetch(url.replace("signature=v1_", "signature=v1_x"))
    assert status == 401 and json.loads(body) == {"code": 401, "message": "invalid signature"}

    up = sbx.upload_url("/tmp/tine-e2e-signed-up.txt")
    status, _ = fetch(up, "POST", b"uploaded", {"Content-Type": "application/octet-stream"})
    assert status == 200
    assert sbx.files.read("/tmp/tine-e2e-signed-up.txt") == "uploaded"
    # A read signature does not allow a write.
    status, _ = fetch(url, "POST", b"x", {"Content-Type": "application/octet-stream"})
    assert status == 401


def test_filesystem_semantics_through_the_proxy(sbx):
    sbx.files.remove("/tmp/tine-e2e-never-existed")
    p = "/tmp/tine-e2e-meta.txt"
    if supports(sbx.files.write, "metadata"):
        sbx.files.write(p, "a", metadata={"k": "v"})
        assert sbx.files.get_info(p).metadata == {"k": "v"}
    sbx.files.write(p, "b")
    info = sbx.files.get_info(p)
    assert getattr(info, "metadata", None) in ({}, None)


def test_a_killed_sandbox_ends_its_command_stream(fresh):
    s = fresh()
    h = s.commands.run("sleep 300", background=True)
    threading.Timer(1.0, lambda: Sandbox.kill(s.sandbox_id)).start()
    with pytest.raises(Exception) as err:
        h.wait()
    not_running = getattr(e2b_exceptions, "SandboxNotRunningException", None)
    if not_running is not None:
        assert isinstance(err.value, not_running), repr(err.value)
    text = str(err.value)
    import e2b.envd.rpc as rpc

    if "end of life" in inspect.getsource(rpc):
        # Every SDK that has the wording gives it (2.45 only after the
        # connection is reset mid-body and /health then says 502).
        assert "The sandbox was killed or reached its end of life" in text, text
    else:
        # Older SDKs (2.25) raise the transport's own error for the reset
        # that E2B's proxy makes too.
        assert "Connection reset by peer" in text, text


def test_a_killed_sandbox_s_ports_answer_e2bs_502_body(fresh):
    s = fresh()
    host = s.get_host(8000)
    s.kill()
    want = {"message": "The sandbox was not found", "sandboxId": s.sandbox_id, "code": 502}
    status, _, body = http("GET", "/", headers={"Host": host}, key=None)
    assert (status, json.loads(body)) == (502, want)
    status, _, body = http("GET", "/health", headers={"E2b-Sandbox-Id": s.sandbox_id}, key=None)
    assert (status, json.loads(body)) == (502, want)


def test_files_outside_home_as_the_default_user_like_envd(sbx):
    """envd serves file calls as root and hands what they create to the
    user; commands still run as the user."""
    sbx.files.write("/0/notes.txt", "notes")
    sbx.files.write("/etc/tine-e2e-app.conf", "conf")
    sbx.files.make_dir("/workspace/x")
    for p in ("/0", "/0/notes.txt", "/etc/tine-e2e-app.conf", "/workspace", "/workspace/x"):
        assert sbx.files.get_info(p).owner == "user", p
    assert sbx.files.get_info("/etc").owner == "root"
    sbx.files.rename("/etc/tine-e2e-app.conf", "/opt/tine-e2e/app.conf")
    assert sbx.files.read("/opt/tine-e2e/app.conf") == "conf"
    assert sbx.files.get_info("/opt/tine-e2e").owner == "user"
    assert sbx.files.read("/etc/shadow").startswith("root:")
    # Commands are still the user's hand, not root's.
    r = sbx.commands.run("touch /etc/tine-e2e-by-user 2>&1; echo rc=$?")
    assert "Permission denied" in r.stdout and "rc=1" in r.stdout, r.stdout
    for p in ("/0", "/opt/tine-e2e", "/workspace"):
        sbx.files.remove(p)
        assert not sbx.files.exists(p)
    # Real errors keep envd's statuses.
    with pytest.raises((e2b_exceptions.NotFoundException, FileNotFoundError)):
        sbx.files.read("/0/notes.txt")
    with pytest.raises(e2b_exceptions.InvalidArgumentException):
        sbx.files.read("/etc")


def test_files_whose_size_stat_cannot_tell_are_read_to_their_end(sbx):
    boot = sbx.commands.run("cat /proc/sys/kernel/random/boot_id").stdout
    assert re.fullmatch(r"[0-9a-f-]{36}\n", boot), boot
    assert sbx.files.read("/proc/sys/kernel/random/boot_id") == boot
    assert sbx.files.read("/sys/class/net/lo/address") == "00:00:00:00:00:00\n"
    assert bytes(sbx.files.read("/proc/self/status", format="bytes")).startswith(b"Name:")
    if supports(sbx.files.read, "gzip"):
        assert sbx.files.read("/proc/sys/kernel/random/boot_id", gzip=True) == boot
    # A byte range (no SDK sends one; curl-style clients do).
    url = sbx.download_url("/proc/sys/kernel/random/boot_id")
    status, body = fetch(url, headers={"Range": "bytes=0-7"})
    assert (status, body) == (206, boot[:8].encode())


def guest_clocks(s):
    """(guest uptime, guest wall clock, host wall clock before, after)."""
    before = time.time()
    out = s.commands.run("cat /proc/uptime; date +%s.%N").stdout.split()
    return float(out[0]), float(out[2]), before, time.time()


def test_wall_clock_and_timers_across_pause_and_resume(fresh):
    s = fresh()
    s.commands.run("cat /proc/uptime > /tmp/t0; sleep 2; cat /proc/uptime > /tmp/t1", background=True)
    # (The host's time from before that reading: the guest's uptime is read
    # after it, so the bound below never counts the call's own latency
    # against the guest.)
    up_before, _, host_start, _ = guest_clocks(s)
    s.pause()
    # Paused for less than a second: the guest's clock is behind by less
    # than that, and must still be set.
    time.sleep(0.5)
    back = Sandbox.connect(s.sandbox_id)
    up_after, wall, host_before, host_after = guest_clocks(back)
    # The guest's monotonic clock stood still while it was paused ...
    assert up_after - up_before < time.time() - host_start - 0.5, (up_before, up_after)
    # ... and its wall clock was set to the host's on resume.
    assert host_before - 0.2 <= wall <= host_after + 0.2, (host_before, wall, host_after)
    # The sleep then ends after 2 s of the guest's own time, no sooner.
    deadline = time.monotonic() + 60
    while not back.files.exists("/tmp/t1"):
        assert time.monotonic() < deadline, "the guest's sleep never ended"
        time.sleep(0.1)
    t0 = float(back.files.read("/tmp/t0").split()[0])
    t1 = float(back.files.read("/tmp/t1").split()[0])
    assert t1 - t0 >= 2.0, (t0, t1)


def test_pause_without_memory_cold_boots_with_the_same_identity(fresh):
    if not supports(Sandbox.pause, "keep_memory"):
        pytest.skip(f"e2b {SDK_VERSION}: pause has no keep_memory")
    s = fresh()
    s.files.write("/home/user/kept.txt", "kept")
    boot = s.files.read("/proc/sys/kernel/random/boot_id")
    assert len(boot) == 37, boot
    s.commands.run("sleep 600", background=True)
    token = s._envd_access_token
    s.pause(keep_memory=False)
    wait_state(s.sandbox_id, "paused", timeout=10)
    back = Sandbox.connect(s.sandbox_id)
    assert back.sandbox_id == s.sandbox_id
    assert back._envd_access_token == token
    assert back.files.read("/home/user/kept.txt") == "kept"
    # Read as E2B's own tests read it: through the files API.
    assert back.files.read("/proc/sys/kernel/random/boot_id") != boot
    assert "sleep 600" not in back.commands.run("ps -eo args").stdout


def test_auto_pause_without_memory_at_timeout(fresh):
    import e2b.sandbox.sandbox_api as api

    if not hasattr(api, "SandboxOnTimeoutPause"):
        pytest.skip(f"e2b {SDK_VERSION}: lifecycle on_timeout has no object form (keep_memory)")
    s = fresh(timeout=5, lifecycle={"on_timeout": {"action": "pause", "keep_memory": False}})
    s.files.write("/home/user/kept.txt", "kept")
    wait_state(s.sandbox_id, "paused")
    back = Sandbox.connect(s.sandbox_id, timeout=120)
    assert back.files.read("/home/user/kept.txt") == "kept"


def test_auto_resume_on_envd_and_host_traffic(fresh):
    if not supports(Sandbox.create, "lifecycle"):
        pytest.skip(f"e2b {SDK_VERSION}: create has no lifecycle")
    s = fresh(timeout=6, lifecycle={"on_timeout": "pause", "auto_resume": True})
    s.commands.run("mkdir -p /tmp/www && echo awake > /tmp/www/index.html")
    s.commands.run("cd /tmp/www && exec python3 -m http.server 8000", background=True)
    for _ in range(100):
        if http("GET", "/", headers={"Host": s.get_host(8000)}, key=None)[0] == 200:
            break
        time.sleep(0.1)
    wait_state(s.sandbox_id, "paused")
    # An envd call wakes it and is served.
    assert s.commands.run("echo resumed").stdout == "resumed\n"
    s.pause()
    wait_state(s.sandbox_id, "paused", timeout=10)
    status, _, body = http("GET", "/index.html", headers={"Host": s.get_host(8000)}, key=None)
    assert (status, body) == (200, b"awake\n")
    assert s.get_info().state.value == "running"


def test_without_auto_resume_a_paused_sandbox_is_not_found(fresh):
    s = fresh()
    s.pause()
    with pytest.raises(Exception) as err:
        s.commands.run("echo hi")
    assert "was not found" in str(err.value) or "paused" in str(err.value), str(err.value)
    assert Sandbox.connect(s.sandbox_id).commands.run("echo hi").stdout == "hi\n"


def test_metrics_over_time(sbx):
    started = sbx.get_info().started_at
    samples = []
    for _ in range(40):
        samples = sbx.get_metrics(start=started - timedelta(seconds=1), end=datetime.now(timezone.utc))
        if len(samples) >= 2:
            break
        time.sleep(1)
    assert len(samples) >= 2, samples
    stamps = [m.timestamp for m in samples]
    assert stamps == sorted(stamps)
    assert all(started - timedelta(seconds=1) <= t for t in stamps)
    long_before = started - timedelta(days=1)
    assert sbx.get_metrics(start=long_before, end=long_before + timedelta(hours=1)) == []


def test_list_is_newest_first_and_filters_by_start_time(fresh):
    from conftest import RUN
    from e2b import SandboxQuery

    if "started_after" not in inspect.signature(SandboxQuery).parameters:
        pytest.skip(f"e2b {SDK_VERSION}: SandboxQuery has no started_after")
    tag = {"group": "fidelity-list"}
    a = fresh(metadata=tag)
    b = fresh(metadata=tag)
    q = SandboxQuery(metadata={"tine-e2e": RUN, **tag})
    pages = Sandbox.list(query=q, limit=1)
    got = []
    while pages.has_next:
        got += [i.sandbox_id for i in pages.next_items()]
    assert got == [b.sandbox_id, a.sandbox_id]
    b_started = b.get_info().started_at
    after = Sandbox.list(query=SandboxQuery(metadata={"tine-e2e": RUN, **tag}, started_after=b_started))
    assert [i.sandbox_id for i in after.next_items()] == [b.sandbox_id]
    stamp = b_started.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    meta = urllib.parse.quote(urllib.parse.urlencode({"tine-e2e": RUN, **tag}))
    status, _, body = http("GET", f"/v2/sandboxes?metadata={meta}&startedBefore={stamp}")
    assert status == 200 and [i["sandboxID"] for i in json.loads(body)] == [a.sandbox_id]


def test_list_snapshots_filters_by_name(fresh):
    if not hasattr(Sandbox, "list_snapshots") or not supports(Sandbox.list_snapshots, "name"):
        pytest.skip(f"e2b {SDK_VERSION}: list_snapshots has no name filter")
    s = fresh()
    named = s.create_snapshot(name=f"fid-{s.sandbox_id}")
    s.create_snapshot()
    try:
        page = Sandbox.list_snapshots(name=f"fid-{s.sandbox_id}").next_items()
        assert [x.snapshot_id for x in page] == [named.snapshot_id]
        assert Sandbox.list_snapshots(name="fid-no-such-name").next_items() == []
    finally:
        for snap in Sandbox.list_snapshots(sandbox_id=s.sandbox_id).next_items():
            Sandbox.delete_snapshot(snap.snapshot_id)


def test_connect_routes_like_create(sbx):
    again = Sandbox.connect(sbx.sandbox_id)
    assert again.get_host(8000) == sbx.get_host(8000)
    assert getattr(again, "envd_api_url", None) == getattr(sbx, "envd_api_url", None)
    assert again._envd_access_token == sbx._envd_access_token
    assert again.commands.run("echo routed").stdout == "routed\n"


def test_idempotency_key_makes_one_sandbox(fresh):
    if not supports(Sandbox.create, "idempotency_key"):
        pytest.skip(f"e2b {SDK_VERSION}: create has no idempotency_key")
    import uuid

    key = f"tine-e2e-{uuid.uuid4()}"
    a = fresh(idempotency_key=key)
    b = fresh(idempotency_key=key)
    assert a.sandbox_id == b.sandbox_id
    assert b.commands.run("echo once").stdout == "once\n"
    # The same key with another request is refused; a bad key too.
    status, _, body = http("POST", "/v2/sandboxes", body={"templateID": "base", "timeout": 7},
                           headers={"Idempotency-Key": key})
    assert status == 409, body
    status, _, _ = http("POST", "/v2/sandboxes", body={}, headers={"Idempotency-Key": "Not Valid"})
    assert status == 400


def test_strict_pause_of_a_healthy_sandbox(fresh):
    if not supports(Sandbox.pause, "strict"):
        pytest.skip(f"e2b {SDK_VERSION}: pause has no strict")
    s = fresh()
    s.pause(strict=True)
    assert s.get_info().state.value == "paused"
    assert Sandbox.connect(s.sandbox_id).commands.run("echo back").stdout == "back\n"


def test_filesystem_only_snapshots_are_refused(sbx):
    status, _, body = http("POST", f"/sandboxes/{sbx.sandbox_id}/snapshots", body={"memory": False})
    assert status == 400 and b"not supported" in body
