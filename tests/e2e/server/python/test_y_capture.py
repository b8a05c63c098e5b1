"""Pause / resume, snapshots and fork through the real SDK (issue
"Templates as warm snapshots; pause, resume, snapshots and fork")."""

import json
import os
import subprocess
import time
import uuid

import pytest
from e2b import NotFoundException, Sandbox, SandboxException, SandboxState

from conftest import HERE, assert_error, http, new_sandbox, qemu_pid, ram_usage

SERVER_SH = os.path.join(os.path.dirname(HERE), "server.sh")

COUNTER = (
    "python3 -c 'import time\n"
    "while True:\n"
    "    open(\"/tmp/counter\", \"a\").write(\"x\")\n"
    "    time.sleep(0.2)'"
)


def wait_for_file(s, path, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if s.files.exists(path):
            return
        time.sleep(0.2)
    raise AssertionError(f"{path} did not appear")


def count(s):
    return int(s.commands.run("wc -c < /tmp/counter").stdout.strip())


def grows(s):
    """The counter process is alive: the file keeps growing."""
    a = count(s)
    deadline = time.time() + 20
    while time.time() < deadline:
        time.sleep(0.5)
        if count(s) > a:
            return True
    return False


def marked_sandbox_with_counter(fresh):
    """A sandbox with a file holding a random mark and a process appending
    to /tmp/counter."""
    s = fresh(timeout=600)
    mark = uuid.uuid4().hex
    s.files.write("/home/user/mark", mark)
    s.commands.run(COUNTER, background=True, timeout=0)
    wait_for_file(s, "/tmp/counter")
    return s, mark


def test_pause_then_resume_keeps_files_and_processes(fresh):
    s, mark = marked_sandbox_with_counter(fresh)
    assert s.pause() is True
    assert Sandbox.get_info(s.sandbox_id).state == SandboxState.PAUSED
    # Pausing a paused sandbox: the SDK gets 409 and returns False.
    assert s.pause() is False
    # Envd traffic to a paused sandbox does not reach a VM.
    status, _, body = http("GET", "/health", headers={"E2b-Sandbox-Id": s.sandbox_id}, key=None)
    assert status == 502 and b"was not found" in body

    resumed = Sandbox.connect(s.sandbox_id)
    assert resumed.get_info().state == SandboxState.RUNNING
    assert resumed.files.read("/home/user/mark") == mark
    assert grows(resumed), "the background process kept running after resume"
    # Connecting to a running sandbox is a no-op that returns it.
    again = Sandbox.connect(s.sandbox_id)
    assert again.commands.run("cat /home/user/mark").stdout == mark


def qemu_or_none(sandbox_id):
    try:
        return qemu_pid(sandbox_id)
    except AssertionError:
        return None


def wait_qemu(sandbox_id, present=True, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        pid = qemu_or_none(sandbox_id)
        if (pid is not None) == present:
            return pid
        time.sleep(0.1)
    raise AssertionError(f"QEMU of {sandbox_id} {'never came' if present else 'never went'}")


def test_a_paused_sandbox_is_restored_ahead_for_its_own_resume(fresh):
    """resume_ahead (default 2): right after a pause the capture is loaded
    into a stopped QEMU under the sandbox's own id; its resume runs that
    very process, whose guest did not run while paused. Paused again, a new
    one; a kill of the paused sandbox ends it."""
    s, mark = marked_sandbox_with_counter(fresh)
    running = qemu_pid(s.sandbox_id)
    before = count(s)
    assert s.pause() is True
    ahead = wait_qemu(s.sandbox_id)
    assert ahead != running, "the paused sandbox's QEMU exited; this one was restored"
    # 6 s paused: a counter that ran would have grown by about 30.
    time.sleep(6)
    resumed = Sandbox.connect(s.sandbox_id)
    assert qemu_pid(s.sandbox_id) == ahead, "the resume ran the QEMU restored ahead"
    grew = count(resumed) - before
    assert grew < 15, f"the guest ran while paused: the counter grew by {grew}"
    assert resumed.files.read("/home/user/mark") == mark
    assert grows(resumed)
    assert resumed.pause() is True
    second = wait_qemu(s.sandbox_id)
    assert second != ahead, "a QEMU serves one resume only"
    resumed.kill()
    assert wait_qemu(s.sandbox_id, present=False) is None


def test_paused_sandbox_survives_a_server_restart(fresh):
    s, mark = marked_sandbox_with_counter(fresh)
    assert s.pause() is True

    for args in (["stop", "KILL"], ["start"]):
        p = subprocess.run([SERVER_SH, *args], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr

    assert Sandbox.get_info(s.sandbox_id).state == SandboxState.PAUSED
    resumed = Sandbox.connect(s.sandbox_id)
    assert resumed.files.read("/home/user/mark") == mark
    assert grows(resumed)


def test_snapshot_create_from_it_and_delete(fresh):
    s = fresh(timeout=600)
    s.files.write("/home/user/state", "at-snapshot")
    snap = s.create_snapshot()
    # The source keeps running and can diverge.
    s.files.write("/home/user/state", "after-snapshot")
    assert snap.snapshot_id in [i.snapshot_id for i in Sandbox.list_snapshots().next_items()]

    child = fresh(template=snap.snapshot_id, timeout=600)
    assert child.files.read("/home/user/state") == "at-snapshot"
    assert s.files.read("/home/user/state") == "after-snapshot"

    assert Sandbox.delete_snapshot(snap.snapshot_id) is True
    assert Sandbox.delete_snapshot(snap.snapshot_id) is False
    with pytest.raises(Exception):
        new_sandbox(template=snap.snapshot_id)
    # A sandbox started from it is unaffected by the deletion.
    assert child.commands.run("cat /home/user/state").stdout == "at-snapshot"


def test_fork_children_share_state_and_diverge(fresh):
    s = fresh(timeout=600)
    s.files.write("/home/user/parent", "p")
    # In-memory state: a Python process holding a value, reachable over a pipe.
    # It also holds 24 MiB of random bytes, so 16 children's private copies
    # of the changed pages (16 × 24 MiB) would outweigh one RAM file of the
    # 256 MiB guest: the fork shares one (`share_fork_ram`).
    s.commands.run(
        "python3 -c 'import time,os; b=os.urandom(24<<20); v=os.urandom(4).hex(); open(\"/tmp/held\",\"w\").write(v); time.sleep(3600)'",
        background=True,
        timeout=0,
    )
    wait_for_file(s, "/tmp/held")
    held = ""
    deadline = time.time() + 30
    while not held and time.time() < deadline:  # created before it is written
        held = s.files.read("/tmp/held")
        time.sleep(0.1)
    assert len(held) == 8

    n = 16
    kids = s.fork(count=n, timeout=600)
    assert len(kids) == n
    for k in kids:
        assert not isinstance(k, Exception), k
    try:
        ids = {k.sandbox_id for k in kids}
        assert len(ids) == n and s.sandbox_id not in ids
        uuids, randoms, hosts, machine_ids = set(), set(), set(), set()
        now = time.time()
        for i, k in enumerate(kids):
            assert k.files.read("/home/user/parent") == "p"
            assert k.files.read("/tmp/held") == held
            out = k.commands.run(
                "pgrep -f 'time.sleep\\(3600\\)' >/dev/null && echo alive; "
                "cat /proc/sys/kernel/random/uuid; "
                "python3 -c 'import os; print(os.urandom(16).hex())'; hostname; date +%s; "
                "cat /etc/machine-id /etc/hostname"
            ).stdout.split()
            assert out[0] == "alive", "the held process came along"
            uuids.add(out[1])
            randoms.add(out[2])
            hosts.add(out[3])
            machine_ids.add(out[5])
            assert out[6] == k.sandbox_id, "/etc/hostname names the child"
            assert abs(int(out[4]) - now) < 120, "the child's clock is current"
            k.files.write("/home/user/mine", str(i))
        assert len(uuids) == n and len(randoms) == n, "every child has its own entropy"
        assert hosts == ids, "each child's host name is its sandbox id"
        assert len(machine_ids) == n and all(len(m) == 32 for m in machine_ids), machine_ids
        for i, k in enumerate(kids):
            assert k.files.read("/home/user/mine") == str(i)
            # The children map the fork capture's own RAM file and share it.
            rss, pss, shared = ram_usage(qemu_pid(k.sandbox_id), "/snapshots/f-")
            assert rss > 0 and shared > 0 and pss < rss, (rss, pss, shared)
        assert not s.files.exists("/home/user/mine"), "the source did not see the children's writes"
        assert s.commands.run("echo ok").stdout == "ok\n", "the source keeps running"
    finally:
        for k in kids:
            if not isinstance(k, Exception):
                k.kill()


def test_capture_bad_input(fresh):
    s = fresh(timeout=600)
    for count in (0, -1, 10_000):
        assert_error(http("POST", f"/sandboxes/{s.sandbox_id}/fork", {"count": count}), 400)
    assert_error(http("POST", "/sandboxes/nope/fork", {"count": 1}), 404)
    assert_error(http("POST", "/sandboxes/nope/pause", {}), 404)
    assert_error(http("POST", "/v2/sandboxes/nope/connect", {}), 404)
    assert_error(http("POST", "/sandboxes/nope/snapshots", {}), 404)
    assert_error(http("DELETE", "/templates/snap-nope"), 404)
    assert_error(http("POST", f"/sandboxes/{s.sandbox_id}/pause", b"{not json"), 400)
    # A killed sandbox cannot be forked or resumed.
    s.kill()
    assert_error(http("POST", f"/sandboxes/{s.sandbox_id}/fork", {"count": 1}), 404)
    assert_error(http("POST", f"/v2/sandboxes/{s.sandbox_id}/connect", {}), 404)
    with pytest.raises(NotFoundException):
        Sandbox.connect(s.sandbox_id)


def pause_captures(sandbox_id):
    root = os.path.join(os.environ["TINE_DATA_DIR"], "snapshots")
    return [d for d in os.listdir(root) if d.startswith(f"p-{sandbox_id}-")]


@pytest.mark.parametrize(
    "file,damage,message",
    [
        ("state", lambda f: f.write(b"XXXX"), "not a QEMU migration stream"),
        ("ram.layer", lambda f: f.truncate(os.fstat(f.fileno()).st_size - 100), "RAM layer"),
    ],
)
def test_damaged_pause_capture_is_a_clear_error(fresh, file, damage, message):
    s = fresh(timeout=600)
    assert s.pause() is True
    (snap,) = pause_captures(s.sandbox_id)
    with open(os.path.join(os.environ["TINE_DATA_DIR"], "snapshots", snap, file), "r+b") as f:
        damage(f)
    with pytest.raises(SandboxException) as e:
        Sandbox.connect(s.sandbox_id)
    assert message in str(e.value)
    # Still paused (nothing else affected), and it can be killed.
    assert Sandbox.get_info(s.sandbox_id).state == SandboxState.PAUSED
    assert s.kill() is True


def capture_parent(snapshot_id):
    meta = os.path.join(os.environ["TINE_DATA_DIR"], "snapshots", snapshot_id, "meta.json")
    with open(meta) as f:
        return json.load(f).get("parent")


def test_pause_resume_cycles_are_compacted(fresh):
    """Each pause is a layer over the previous capture; past
    compact_after_layers (3) the chain is folded onto the template in the
    background and the captures only it used are deleted."""
    s, mark = marked_sandbox_with_counter(fresh)
    for i in range(6):
        s.files.write("/home/user/cycle", str(i))
        assert s.pause() is True
        s = Sandbox.connect(s.sandbox_id, timeout=600)
        assert s.files.read("/home/user/mark") == mark
        assert s.files.read("/home/user/cycle") == str(i)
        assert grows(s), f"the process runs after resume {i}"
    deadline = time.time() + 60
    while time.time() < deadline:
        caps = pause_captures(s.sandbox_id)
        parents = [capture_parent(c) for c in caps]
        if len(caps) <= 3 and any(p and p.startswith("tpl-") for p in parents):
            break
        time.sleep(0.5)
    assert len(caps) <= 3, f"old captures are collected: {caps}"
    assert any(p and p.startswith("tpl-") for p in parents), f"a capture sits on the template: {parents}"
    # And the compacted chain still restores everything.
    assert s.pause() is True
    s = Sandbox.connect(s.sandbox_id, timeout=600)
    assert s.files.read("/home/user/cycle") == "5"
    assert grows(s)


@pytest.mark.machinery
def test_snapshot_after_writing_a_gib_restores_it(fresh):
    s = fresh(timeout=900)
    out = s.commands.run(
        "dd if=/dev/urandom of=/home/user/big bs=1M count=1024 status=none && sha256sum /home/user/big | cut -c1-64",
        timeout=900,
    ).stdout.strip()
    assert len(out) == 64
    snap = s.create_snapshot()
    child = fresh(template=snap.snapshot_id, timeout=900)
    got = child.commands.run("sha256sum /home/user/big | cut -c1-64", timeout=900).stdout.strip()
    assert got == out
    # And a snapshot after writing nothing more restores too.
    snap2 = s.create_snapshot()
    child2 = fresh(template=snap2.snapshot_id, timeout=900)
    assert child2.commands.run("stat -c %s /home/user/big").stdout.strip() == str(1 << 30)
    for x in (snap, snap2):
        Sandbox.delete_snapshot(x.snapshot_id)


def test_auto_pause_at_timeout_then_resume(fresh):
    s = fresh(timeout=4, lifecycle={"on_timeout": "pause"})
    s.files.write("/home/user/mark", "kept")
    deadline = time.time() + 60
    while time.time() < deadline and Sandbox.get_info(s.sandbox_id).state != SandboxState.PAUSED:
        time.sleep(0.5)
    assert Sandbox.get_info(s.sandbox_id).state == SandboxState.PAUSED, "paused, not killed, at its timeout"
    resumed = Sandbox.connect(s.sandbox_id, timeout=600)
    assert resumed.files.read("/home/user/mark") == "kept"


def test_clock_and_timers_across_snapshot_restore_and_fork(fresh):
    """Guests run on the TSC clock (KVM: kvm-clock), never on jiffies; a
    sleep started before a snapshot or a fork ends in every copy after the
    guest's own 3 s, and each copy's wall clock is set to the host's."""
    s = fresh(timeout=600)
    cs = s.commands.run("cat /sys/devices/system/clocksource/clocksource0/current_clocksource").stdout.strip()
    assert cs in ("tsc", "kvm-clock"), cs
    s.commands.run("cat /proc/uptime > /tmp/t0; sleep 3; cat /proc/uptime > /tmp/t1", background=True)
    wait_for_file(s, "/tmp/t0")
    snap = s.create_snapshot()
    kids = s.fork(count=2, timeout=600)
    for k in kids:
        assert not isinstance(k, Exception), k
    try:
        copies = [s, fresh(template=snap.snapshot_id, timeout=600), *kids]
        for c in copies:
            before = time.time()
            wall = float(c.commands.run("date +%s.%N").stdout)
            assert before - 0.2 <= wall <= time.time() + 0.2, (before, wall)
        for c in copies:
            wait_for_file(c, "/tmp/t1")
            t0 = float(c.files.read("/tmp/t0").split()[0])
            t1 = float(c.files.read("/tmp/t1").split()[0])
            assert t1 - t0 >= 3.0, (c.sandbox_id, t0, t1)
    finally:
        for k in kids:
            if not isinstance(k, Exception):
                k.kill()
        Sandbox.delete_snapshot(snap.snapshot_id)
