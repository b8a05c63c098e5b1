"""A server restart with live sandboxes: the new server adopts the running
VMs, so they are still listed and usable through it. (Runs last: it
restarts the server that the other tests use.)"""

import json
import os
import subprocess
import urllib.error
import urllib.request
import uuid

import pytest
from e2b import ALL_TRAFFIC, NotFoundException, Sandbox, SandboxQuery, SandboxState, Volume

from conftest import API, HERE, RUN, http

SERVER_SH = os.path.join(os.path.dirname(HERE), "server.sh")


def server(*args, env=None):
    p = subprocess.run([SERVER_SH, *args], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, **(env or {})))
    assert p.returncode == 0, f"server.sh {' '.join(args)}: {p.stderr}"


def server_up():
    try:
        urllib.request.urlopen(API + "/health", timeout=2)
        return True
    except (urllib.error.URLError, OSError):
        return False


@pytest.mark.parametrize("signal", ["TERM", "KILL"])
def test_restart_keeps_live_sandboxes(fresh, sbx, signal):
    s = fresh(
        timeout=600,
        envs={"TINE_E2E_ENV": "restart"},
        metadata={"group": f"restart-{signal}"},
        # A policy by name: its firewall is in the sandbox's namespace, its
        # egress proxy in the server process, which the restart replaces.
        network={"allow_out": ["allowed.test"], "deny_out": [ALL_TRAFFIC]},
    )
    s.commands.run("echo '203.0.113.10 allowed.test' >> /etc/hosts", user="root")
    mark = uuid.uuid4().hex
    s.files.write("/tmp/tine-e2e-restart", mark)
    bg = s.commands.run("sleep 3600", background=True)
    end_before = s.get_info().end_at
    # A volume and its files outlive the server.
    vol = Volume.create(f"restart-{signal}-{mark[:8]}")
    vol.write_file("/kept/mark.txt", mark)
    # A sandbox that mounts it keeps its mount (the new server serves it,
    # and the guest's NFS client presents the handles it had).
    m = fresh(timeout=600, volume_mounts={"/mnt/v": vol}, metadata={"group": f"restart-mnt-{signal}"})
    assert m.commands.run("cat /mnt/v/kept/mark.txt").stdout == mark

    server("stop", signal)
    assert not server_up()
    server("start")

    q = SandboxQuery(metadata={"tine-e2e": RUN, "group": f"restart-{signal}"})
    listed = Sandbox.list(query=q).next_items()
    assert [i.sandbox_id for i in listed] == [s.sandbox_id]
    assert listed[0].state == SandboxState.RUNNING
    info = s.get_info()
    assert info.state == SandboxState.RUNNING
    assert info.end_at == end_before  # the timeout is kept, not reset
    # The same VM, not a new one: its files and processes are still there.
    assert s.files.read("/tmp/tine-e2e-restart") == mark
    assert bg.pid in [p.pid for p in s.commands.list()]
    assert s.commands.run("echo $TINE_E2E_ENV").stdout == "restart\n"
    # Its network policy holds: the name passes, the raw address does not.
    web = s.commands.run("curl -sS -m 6 http://allowed.test/", timeout=30).stdout
    assert web == "inet 203.0.113.10 host=allowed.test\n"
    raw = s.commands.run("curl -s --fail -m 6 http://203.0.113.10/; echo rc=$?", timeout=30).stdout
    assert not raw.endswith("rc=0\n"), raw
    # The session's shared sandbox made it through as well.
    assert sbx.commands.run("true").exit_code == 0
    assert Volume.get_info(vol.volume_id).token == vol.token
    assert vol.read_file("/kept/mark.txt") == mark
    assert m.commands.run("cat /mnt/v/kept/mark.txt").stdout == mark
    m.commands.run("echo after > /mnt/v/kept/after.txt")
    assert vol.read_file("/kept/after.txt") == "after\n"
    assert m.kill() is True
    assert Volume.destroy(vol.volume_id)
    # And the new server manages them as usual.
    assert s.get_metrics()
    assert s.kill() is True
    assert Sandbox.kill(s.sandbox_id) is False


def test_a_vm_that_died_while_the_server_was_down_is_reported_dead(fresh):
    s = fresh(timeout=600, metadata={"group": "restart-dead"})
    assert s.commands.run("true").exit_code == 0
    server("stop", "TERM")
    # Kill this sandbox's QEMU (found by its id on the command line).
    p = subprocess.run(["pgrep", "-f", f"qemu-system.*/vms/{s.sandbox_id}/"], capture_output=True, text=True)
    pids = [int(x) for x in p.stdout.split()]
    assert len(pids) == 1, f"expected one QEMU for {s.sandbox_id}, found {pids}"
    os.kill(pids[0], 9)
    server("start")

    with pytest.raises(NotFoundException):
        s.get_info()
    q = SandboxQuery(metadata={"tine-e2e": RUN, "group": "restart-dead"})
    assert Sandbox.list(query=q).next_items() == []
    assert s.kill() is False
    # Its envd traffic is refused by the proxy, not sent anywhere.
    with pytest.raises(Exception):
        s.commands.run("true", request_timeout=30)


# (failpoint, the request that reaches it, the state after the restart)
CRASH_POINTS = [
    ("pause.before_capture", "pause", "running"),
    ("pause.after_capture", "pause", "paused"),
    # QEMU has exited and the disk is in the capture; meta.json is not.
    ("capture.after_exit", "pause", "paused"),
    ("snapshot.before_capture", "snapshot", "running"),
    ("snapshot.after_capture", "snapshot", "running"),
    ("fork.before_capture", "fork", "running"),
    ("fork.after_capture", "fork", "running"),
    ("resume.after_start", "resume", "paused"),
]

OPS = {
    "pause": ("POST", "/sandboxes/{id}/pause", {}),
    "snapshot": ("POST", "/sandboxes/{id}/snapshots", {}),
    "fork": ("POST", "/sandboxes/{id}/fork", {"count": 2}),
    "resume": ("POST", "/sandboxes/{id}/connect", {"timeout": 600}),
}


def marked_sandbox(fresh, group):
    """A sandbox with a file and 8 MiB in memory to check later."""
    s = fresh(timeout=600, metadata={"group": group})
    mark = uuid.uuid4().hex
    s.files.write("/tmp/tine-e2e-crash", mark)
    blob = s.commands.run("head -c 8M /dev/urandom > /dev/shm/blob && sha256sum < /dev/shm/blob",
                          user="root").stdout
    return s, mark, blob


def assert_whole(s, mark, blob):
    """The sandbox resumes (if paused), answers, and has its file and memory."""
    again = Sandbox.connect(s.sandbox_id, timeout=600)
    assert again.get_info().state == SandboxState.RUNNING
    assert again.commands.run("true", request_timeout=60).exit_code == 0
    assert again.files.read("/tmp/tine-e2e-crash") == mark
    assert again.commands.run("sha256sum < /dev/shm/blob", user="root").stdout == blob
    return again


def captures_without_rows(sandbox_id):
    """Capture directories of this sandbox that no row names (and that no
    VM of it needs: those of its live disk are allowed)."""
    import json
    import sqlite3

    data = os.environ["TINE_DATA_DIR"]
    with sqlite3.connect(f"file:{data}/tine.db?mode=ro", uri=True) as db:
        rows = {r[0] for r in db.execute("SELECT id FROM snapshots")}
    vm = os.path.join(data, "vms", sandbox_id, "vm.json")
    needed = set()
    if os.path.exists(vm):
        with open(vm) as f:
            rec = json.load(f)
        needed = {os.path.basename(os.path.dirname(d)) for d in rec.get("disk_over") or []}
    made = set()
    for d in os.listdir(os.path.join(data, "snapshots")):
        meta = os.path.join(data, "snapshots", d, "meta.json")
        if d.startswith(f"p-{sandbox_id}-"):
            made.add(d)
        elif os.path.exists(meta):
            with open(meta) as f:
                if json.load(f).get("source_vm") == sandbox_id:
                    made.add(d)
    return made - rows - needed


def stray_vms():
    """VMs (a directory, or a QEMU process) of sandboxes that are not
    running: nothing owns them."""
    import sqlite3

    data = os.environ["TINE_DATA_DIR"]
    with sqlite3.connect(f"file:{data}/tine.db?mode=ro", uri=True) as db:
        not_running = {r[0] for r in db.execute("SELECT id FROM sandboxes WHERE state != 'running'")}
    dirs = set(os.listdir(os.path.join(data, "vms"))) if os.path.isdir(os.path.join(data, "vms")) else set()
    p = subprocess.run(["pgrep", "-af", "qemu-system"], capture_output=True, text=True)
    procs = {m for line in p.stdout.splitlines() for m in
             [seg.split("/")[0] for seg in line.split(os.path.join(data, "vms") + "/")[1:]]}
    return sorted((dirs | procs) & not_running)


@pytest.mark.parametrize("point,op,after", CRASH_POINTS)
def test_an_operation_cut_short_by_a_crash_loses_nothing(fresh, point, op, after):
    """The server dies (SIGKILL, from a failpoint) in the middle of an
    operation: the restarted server finishes it from its files or undoes
    it; either way the sandbox, its memory and its files are whole, and
    no capture is left that nothing owns."""
    s, mark, blob = marked_sandbox(fresh, f"crash-{point}")
    if op == "resume":
        assert s.pause() is True
    server("stop", "TERM")
    server("start", env={"TINE_FAILPOINTS": point})
    method, path, body = OPS[op]
    with pytest.raises(Exception):
        # The server kills itself at the failpoint: no answer.
        code, _, answer = http(method, path.format(id=s.sandbox_id), body, timeout=120)
        raise AssertionError(f"{op} answered {code}: {answer[:200]!r}")
    assert not server_up()
    # (Waits until the dead process is reaped; it is dead already.)
    server("stop", "KILL")
    server("start")

    assert s.get_info().state.value == after
    if point == "snapshot.after_capture":
        # The capture was whole: it is kept, as if the request had ended.
        code, _, listed = http("GET", f"/snapshots?sandboxID={s.sandbox_id}")
        assert code == 200 and len(json.loads(listed)) == 1, listed
    again = assert_whole(s, mark, blob)
    assert captures_without_rows(s.sandbox_id) == set()
    assert stray_vms() == []
    # Fork children the crash cut off are not left running or listed.
    q = SandboxQuery(metadata={"tine-e2e": RUN, "group": f"crash-{point}"})
    assert [i.sandbox_id for i in Sandbox.list(query=q).next_items()] == [s.sandbox_id]
    # And it pauses and resumes as usual.
    assert again.pause() is True
    assert Sandbox.connect(s.sandbox_id).commands.run("cat /tmp/tine-e2e-crash").stdout == mark
    assert Sandbox.kill(s.sandbox_id) is True


def test_random_sigkills_during_captures_lose_and_freeze_nothing(fresh):
    """Rounds of: a pause, snapshot, fork or resume in flight, the server
    killed (SIGKILL) at a random moment, a restart. Every sandbox is then
    running and answering, or paused and resuming, with its files and
    memory; none is lost and none is listed running but silent."""
    import random
    import threading
    import time

    rng = random.Random(RUN)
    rounds = int(os.environ.get("TINE_E2E_KILL_ROUNDS", "10"))
    s, mark, blob = marked_sandbox(fresh, "sigkill-loop")
    seen = []
    for n in range(rounds):
        op = rng.choice(["pause", "snapshot", "fork", "resume"])
        if op == "resume" and s.get_info().state != SandboxState.PAUSED:
            assert s.pause() is True
        elif op != "resume" and s.get_info().state == SandboxState.PAUSED:
            Sandbox.connect(s.sandbox_id, timeout=600)
        method, path, body = OPS[op]
        t = threading.Thread(target=lambda: http(method, path.format(id=s.sandbox_id), body, timeout=60),
                             daemon=True)
        t.start()
        delay = rng.uniform(0.0, 1.5)
        time.sleep(delay)
        server("stop", "KILL")
        server("start")
        t.join(timeout=60)
        state = s.get_info().state
        seen.append((n, op, round(delay, 2), state.value))
        assert state in (SandboxState.RUNNING, SandboxState.PAUSED), seen
        # Whatever else the round left (fork children) answers, or is gone.
        q = SandboxQuery(metadata={"tine-e2e": RUN, "group": "sigkill-loop"})
        for info in Sandbox.list(query=q).next_items():
            if info.sandbox_id != s.sandbox_id and info.state == SandboxState.RUNNING:
                child = Sandbox.connect(info.sandbox_id)
                assert child.files.read("/tmp/tine-e2e-crash") == mark, (info.sandbox_id, seen)
                child.kill()
        assert_whole(s, mark, blob)
        assert captures_without_rows(s.sandbox_id) == set(), seen
        assert stray_vms() == [], seen
    print("rounds:", seen)
    assert Sandbox.kill(s.sandbox_id) is True


def test_create_after_restart(fresh):
    s = fresh()
    assert s.commands.run("echo fine").stdout == "fine\n"


def test_a_restart_ends_a_running_build_and_leaves_nothing():
    """A build cut off by a restart ends as an error; its VM goes, no
    template is left, and the layer it finished is reused next time."""
    import time
    from e2b import Template

    data = os.environ["TINE_DATA_DIR"]
    # (An earlier run's template of that name: the data dir outlives runs.)
    assert http("DELETE", "/templates/e2e-restart-build")[0] in (204, 404)
    step = f"echo {RUN} > /tmp/restart-layer"
    t = Template().from_template("base").run_cmd(step).run_cmd("sleep 600")
    info = Template.build_in_background(t, "e2e-restart-build", cpu_count=1, memory_mb=256)
    deadline = time.time() + 300
    while True:
        st = Template.get_build_status(info, logs_offset=0)
        if any(e.message.startswith("[2/2] RUN sleep") for e in st.log_entries):
            break
        assert st.status.value in ("waiting", "building"), st
        assert time.time() < deadline
        time.sleep(0.5)
    server("stop", "KILL")
    server("start")
    st = Template.get_build_status(info)
    assert st.status.value == "error" and "server stopped" in st.reason.message, st
    vms = os.listdir(os.path.join(data, "vms")) if os.path.isdir(os.path.join(data, "vms")) else []
    assert [v for v in vms if v.startswith("build-")] == []
    assert not Template.exists("e2e-restart-build")
    # The finished first step is a layer the next build reuses.
    logs = []
    Template.build(Template().from_template("base").run_cmd(step), "e2e-restart-build",
                   cpu_count=1, memory_mb=256, on_build_logs=logs.append)
    assert any(m.message.startswith("CACHED [1/1] RUN") for m in logs), [m.message for m in logs]


def test_a_compaction_cut_short_loses_nothing(fresh):
    """The server dies while compacting a capture chain (the merged RAM
    layer is in place, the disk and meta.json are not): the sandbox
    resumes whole, and compacts as usual afterwards."""
    s, mark, blob = marked_sandbox(fresh, "crash-compact")
    server("stop", "TERM")
    server("start", env={"TINE_FAILPOINTS": "compact.after_layer"})
    # Every pause adds a layer; past compact_after_layers (3) the chain is
    # compacted in the background, where the server dies.
    for _ in range(8):
        if not server_up():
            break
        try:
            http("POST", f"/sandboxes/{s.sandbox_id}/pause", {}, timeout=120)
            http("POST", f"/sandboxes/{s.sandbox_id}/connect", {"timeout": 600}, timeout=120)
        except Exception:
            break
        import time

        time.sleep(1)
    assert not server_up(), "no compaction reached its failpoint"
    server("stop", "KILL")
    server("start")
    again = assert_whole(s, mark, blob)
    for _ in range(4):
        assert again.pause() is True
        again = assert_whole(s, mark, blob)
    assert captures_without_rows(s.sandbox_id) == set()
    assert Sandbox.kill(s.sandbox_id) is True


def test_a_collection_cut_short_loses_nothing(fresh):
    """The server dies between deleting a collected capture's files and its
    row: at restart the row goes too, and other sandboxes are untouched."""
    import sqlite3

    other, mark, blob = marked_sandbox(fresh, "crash-gc")
    gone = fresh(timeout=600, metadata={"group": "crash-gc"})
    assert gone.pause() is True
    data = os.environ["TINE_DATA_DIR"]
    with sqlite3.connect(f"file:{data}/tine.db?mode=ro", uri=True) as db:
        (capture,) = db.execute("SELECT snapshot_id FROM sandboxes WHERE id = ?", (gone.sandbox_id,)).fetchone()
    server("stop", "TERM")
    server("start", env={"TINE_FAILPOINTS": "gc.after_delete"})
    with pytest.raises(Exception):
        code, _, answer = http("DELETE", f"/sandboxes/{gone.sandbox_id}", timeout=120)
        raise AssertionError(f"the kill answered {code}: {answer[:200]!r}")
    server("stop", "KILL")
    server("start")
    assert not os.path.exists(os.path.join(data, "snapshots", capture))
    with sqlite3.connect(f"file:{data}/tine.db?mode=ro", uri=True) as db:
        assert db.execute("SELECT 1 FROM snapshots WHERE id = ?", (capture,)).fetchone() is None
    with pytest.raises(NotFoundException):
        Sandbox.connect(gone.sandbox_id)
    assert_whole(other, mark, blob)
    assert Sandbox.kill(other.sandbox_id) is True


def test_qemu_killed_during_a_capture_leaves_a_clear_error_and_nothing_half_done(fresh):
    """QEMU dies (SIGKILL) while a pause captures it: the request gets an
    error in the E2B shape, the sandbox is reported dead (its VM and its
    memory are gone), no half-written capture or VM is left, and the
    server goes on serving the others."""
    import threading
    import time

    other, mark, blob = marked_sandbox(fresh, "qemu-killed")
    s = fresh(timeout=600, metadata={"group": "qemu-killed"})
    # 96 MiB of changed pages: the capture's RAM layer takes a while.
    s.commands.run("head -c 96M /dev/urandom > /dev/shm/big", user="root", timeout=300)
    data = os.environ["TINE_DATA_DIR"]
    got = {}
    t = threading.Thread(target=lambda: got.update(r=http("POST", f"/sandboxes/{s.sandbox_id}/pause", {},
                                                           timeout=300)), daemon=True)
    t.start()
    deadline = time.time() + 60
    while not any(d.startswith(f"p-{s.sandbox_id}-") for d in os.listdir(os.path.join(data, "snapshots"))):
        assert time.time() < deadline and t.is_alive(), got
        time.sleep(0.002)
    subprocess.run(["pkill", "-KILL", "-f", f"qemu-system.*/vms/{s.sandbox_id}/"], check=True)
    t.join(timeout=300)
    code, _, body = got["r"]
    assert code >= 400, (code, body[:300])
    doc = json.loads(body)
    assert doc["code"] == code and isinstance(doc["message"], str), doc
    # Dead, and said so; nothing of the capture or the VM is left.
    assert http("GET", f"/sandboxes/{s.sandbox_id}")[0] == 404
    assert [d for d in os.listdir(os.path.join(data, "snapshots")) if d.startswith(f"p-{s.sandbox_id}-")] == []
    assert not os.path.exists(os.path.join(data, "vms", s.sandbox_id))
    assert stray_vms() == []
    assert_whole(other, mark, blob)
    assert Sandbox.kill(other.sandbox_id) is True
