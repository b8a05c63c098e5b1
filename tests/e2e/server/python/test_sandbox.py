"""One sandbox through the real Python SDK against `tine serve`: create,
commands, files, pty, watch_dir, get_info, get_metrics, get_host, connect,
set_timeout and kill."""

import json
import time
import uuid
from datetime import datetime, timezone

import pytest
from e2b import (
    CommandExitException,
    FileType,
    NotFoundException,
    PtySize,
    Sandbox,
    SandboxState,
)

from conftest import API, PORT, RUN, http


def test_create_returns_a_usable_sandbox(sbx):
    assert sbx.sandbox_id
    assert sbx.envd_api_url == API  # E2B_SANDBOX_URL is used as is
    assert sbx.is_running()


def test_commands_run_foreground(sbx):
    r = sbx.commands.run("echo out; echo err >&2; exit 0")
    assert r.exit_code == 0
    assert r.stdout == "out\n"
    assert r.stderr == "err\n"
    with pytest.raises(CommandExitException) as e:
        sbx.commands.run("echo before; exit 7")
    assert e.value.exit_code == 7
    assert e.value.stdout == "before\n"


def test_commands_run_in_the_guest_not_the_host(sbx):
    # The sandbox has its own kernel: its boot id differs from the host's.
    with open("/proc/sys/kernel/random/boot_id") as f:
        host_boot = f.read().strip()
    guest_boot = sbx.commands.run("cat /proc/sys/kernel/random/boot_id").stdout.strip()
    assert guest_boot and guest_boot != host_boot


def test_commands_run_background(sbx):
    h = sbx.commands.run("sleep 0.5; echo done-bg", background=True)
    assert h.pid > 0
    r = h.wait()
    assert r.exit_code == 0
    assert r.stdout == "done-bg\n"

    h = sbx.commands.run("sleep 600", background=True)
    assert h.pid in [p.pid for p in sbx.commands.list()]
    assert h.kill() is True
    with pytest.raises(CommandExitException):
        h.wait()


def test_env_vars_from_create_reach_commands(sbx):
    assert sbx.commands.run("echo $TINE_E2E_ENV").stdout == "from-create\n"
    # Per-command envs win, and the create ones are still there.
    r = sbx.commands.run("echo $TINE_E2E_ENV $OTHER", envs={"OTHER": "per-cmd"})
    assert r.stdout == "from-create per-cmd\n"


def test_files_write_read_list(sbx):
    d = f"/tmp/tine-e2e-{uuid.uuid4().hex[:8]}"
    info = sbx.files.write(f"{d}/hello.txt", "hello tine\n")
    assert info.path == f"{d}/hello.txt"
    assert sbx.files.read(f"{d}/hello.txt") == "hello tine\n"
    blob = bytes(range(256)) * 400
    sbx.files.write(f"{d}/blob.bin", blob)
    assert bytes(sbx.files.read(f"{d}/blob.bin", format="bytes")) == blob
    sbx.files.make_dir(f"{d}/sub")
    entries = {e.name: e for e in sbx.files.list(d)}
    assert set(entries) == {"hello.txt", "blob.bin", "sub"}
    assert entries["sub"].type == FileType.DIR
    assert entries["blob.bin"].type == FileType.FILE
    assert entries["blob.bin"].size == len(blob)
    # What the SDK wrote is what a command in the guest sees.
    assert sbx.commands.run(f"cat {d}/hello.txt").stdout == "hello tine\n"
    with pytest.raises(NotFoundException):
        sbx.files.read(f"{d}/missing.txt")


def test_pty_basic(sbx):
    out = []
    t = sbx.pty.create(PtySize(cols=100, rows=30))
    sbx.pty.send_stdin(t.pid, b"stty size; echo pty-$((40+2)); exit\n")
    r = t.wait(on_pty=lambda d: out.append(d))
    text = b"".join(out).decode(errors="replace")
    assert "30 100" in text
    assert "pty-42" in text
    assert r.exit_code == 0


def test_watch_dir(sbx):
    d = f"/tmp/tine-e2e-watch-{uuid.uuid4().hex[:8]}"
    sbx.files.make_dir(d)
    h = sbx.files.watch_dir(d)
    try:
        sbx.files.write(f"{d}/seen.txt", "x")
        events = []
        for _ in range(100):
            events += h.get_new_events()
            if any(e.name == "seen.txt" for e in events):
                break
            time.sleep(0.1)
        assert any(e.name == "seen.txt" for e in events), events
    finally:
        h.stop()


def test_get_info_fields(sbx):
    i = sbx.get_info()
    assert i.sandbox_id == sbx.sandbox_id
    assert i.template_id == "base"
    assert i.metadata == {"tine-e2e": RUN}
    assert i.state == SandboxState.RUNNING
    assert i.cpu_count == 1  # default_cpu_count in run.sh's config
    assert i.memory_mb == 256  # default_memory_mb
    assert i.envd_version
    assert i.started_at.tzinfo is not None and i.end_at.tzinfo is not None
    assert i.started_at <= datetime.now(timezone.utc)
    assert i.end_at > i.started_at
    # The class method gives the same record.
    assert Sandbox.get_info(sbx.sandbox_id).sandbox_id == sbx.sandbox_id


def test_get_info_matches_the_guest(sbx):
    # memoryMB is honoured: the guest's RAM is at most what was asked for.
    kb = int(sbx.commands.run("awk '/MemTotal/ {print $2}' /proc/meminfo").stdout)
    assert 128 * 1024 < kb <= 256 * 1024
    assert sbx.commands.run("nproc").stdout.strip() == "1"


def test_get_metrics(sbx):
    ms = sbx.get_metrics()
    assert len(ms) >= 1
    m = ms[-1]
    assert m.cpu_count == 1
    assert 0 <= m.cpu_used_pct <= 100
    assert 0 < m.mem_used <= m.mem_total <= 256 * 1024 * 1024
    assert 0 < m.disk_used <= m.disk_total
    assert isinstance(m.timestamp, datetime)


def test_get_host_reaches_a_server_in_the_sandbox(sbx):
    d = f"/tmp/tine-e2e-www-{uuid.uuid4().hex[:8]}"
    sbx.files.write(f"{d}/marker-{RUN}.txt", "hi")
    srv = sbx.commands.run(f"cd {d} && exec python3 -m http.server 8000", background=True)
    try:
        host = sbx.get_host(8000)
        assert host == f"8000-{sbx.sandbox_id}.localhost:{PORT}"
        # *.localhost may not resolve here: send to the server with that Host.
        status, body = None, b""
        for _ in range(100):
            status, _, body = http("GET", "/", headers={"Host": host}, key=None)
            if status == 200:
                break
            time.sleep(0.1)
        assert status == 200, body[:300]
        assert b"Directory listing for /" in body
        assert f"marker-{RUN}.txt".encode() in body
        # A port nothing listens on is an error, not a hang or a crash.
        status, _, _ = http("GET", "/", headers={"Host": f"8001-{sbx.sandbox_id}.localhost:{PORT}"}, key=None)
        assert status >= 500
    finally:
        srv.kill()


def test_connect_from_a_second_handle(sbx):
    other = Sandbox.connect(sbx.sandbox_id)
    assert other.sandbox_id == sbx.sandbox_id
    name = f"/tmp/tine-e2e-connect-{uuid.uuid4().hex[:8]}"
    sbx.files.write(name, "via the first handle")
    assert other.files.read(name) == "via the first handle"
    assert other.commands.run("echo $TINE_E2E_ENV").stdout == "from-create\n"


def test_connect_route_for_a_running_sandbox(sbx):
    # What Sandbox.connect sends (E2B-COMPAT.md B): 200 and a Sandbox.
    status, _, body = http("POST", f"/v2/sandboxes/{sbx.sandbox_id}/connect", body={})
    assert status == 200, body[:300]
    doc = json.loads(body)
    assert doc["sandboxID"] == sbx.sandbox_id
    assert doc["envdAccessToken"] == sbx._envd_access_token


def test_connect_to_an_unknown_sandbox_fails():
    with pytest.raises(NotFoundException):
        Sandbox.connect("nosuchsandbox0000")


def test_set_timeout_then_the_sandbox_is_gone(fresh):
    s = fresh(timeout=600)
    before = s.get_info().end_at
    s.set_timeout(3)
    after = s.get_info().end_at
    assert after < before
    gone = False
    for _ in range(120):
        try:
            s.get_info()
        except NotFoundException:
            gone = True
            break
        time.sleep(0.5)
    assert gone, "the sandbox outlived its timeout"
    assert s.kill() is False
    assert Sandbox.kill(s.sandbox_id) is False
    assert not s.is_running()
    ids = [i.sandbox_id for i in Sandbox.list(query=_q()).next_items()]
    assert s.sandbox_id not in ids


def test_kill(fresh):
    s = fresh()
    assert s.commands.run("true").exit_code == 0
    assert s.kill() is True
    with pytest.raises(NotFoundException):
        s.get_info()
    assert not s.is_running()
    assert Sandbox.kill(s.sandbox_id) is False
    with pytest.raises(Exception):
        s.commands.run("true", request_timeout=30)


def _q():
    from e2b import SandboxQuery

    return SandboxQuery(metadata={"tine-e2e": RUN})
