"""Isolation (issue "Isolation: teams, a jailed unprivileged QEMU per
sandbox, and resource limits"): teams' keys see only their own things, team
limits give 429, every QEMU runs jailed, and a hostile guest hits its own
limits without harming another sandbox or the server."""

import json
import os
import subprocess
import time
import uuid

import pytest
from e2b import Sandbox
from e2b.exceptions import NotFoundException

from conftest import API, assert_error, http, new_sandbox, qemu_pid, team_key

DATA = os.environ["TINE_DATA_DIR"]
SHM = os.environ["TINE_SHM_DIR"]


@pytest.fixture(scope="module")
def other_key():
    return team_key("other", "iso-other")


@pytest.fixture(scope="module")
def limited_key():
    # [teams.limited] in run.sh's config: 1 sandbox, 1 vCPU, 512 MiB, 1
    # byte of snapshots.
    return team_key("limited", "iso-limited")


def test_team_keys_are_checked_on_the_command_line():
    bad = subprocess.run(
        [os.environ["TINE_BIN"], "keys", "create", "--team", "no spaces"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0 and "team name" in bad.stderr


def test_another_teams_sandbox_is_404_on_every_route(fresh, other_key):
    s = fresh(timeout=600)
    sid = s.sandbox_id
    snap = s.create_snapshot()
    unknown = "i" + uuid.uuid4().hex[:19]
    routes = [
        ("GET", f"/sandboxes/{{}}", None),
        ("DELETE", f"/sandboxes/{{}}", None),
        ("POST", f"/sandboxes/{{}}/timeout", {"timeout": 60}),
        ("POST", f"/sandboxes/{{}}/refreshes", {"duration": 10}),
        ("GET", f"/sandboxes/{{}}/metrics", None),
        ("GET", f"/sandboxes/{{}}/logs", None),
        ("GET", f"/v2/sandboxes/{{}}/logs", None),
        ("POST", f"/sandboxes/{{}}/pause", {}),
        ("POST", f"/sandboxes/{{}}/connect", {"timeout": 60}),
        ("POST", f"/v2/sandboxes/{{}}/connect", {"timeout": 60}),
        ("POST", f"/sandboxes/{{}}/resume", {"timeout": 60}),
        ("POST", f"/sandboxes/{{}}/snapshots", {}),
        ("POST", f"/sandboxes/{{}}/fork", {"count": 1}),
        ("PUT", f"/sandboxes/{{}}/network", {"allowOut": ["1.1.1.1"]}),
    ]
    for method, path, body in routes:
        theirs = assert_error(http(method, path.format(sid), body, key=other_key), 404)
        nobody = assert_error(http(method, path.format(unknown), body, key=other_key), 404)
        # Same answer as for an id that does not exist: nothing to probe.
        assert theirs["message"] == nobody["message"].replace(unknown, sid), (path, theirs, nobody)
    # Lists leave it out.
    for path in ("/v2/sandboxes", "/sandboxes", "/v2/sandboxes?state=running,paused"):
        code, _, body = http("GET", path, key=other_key)
        assert code == 200 and sid not in body.decode(), path
    code, _, body = http("GET", "/snapshots", key=other_key)
    assert code == 200 and snap.snapshot_id not in body.decode()
    # Its snapshot can neither be started nor deleted by the other team.
    assert_error(http("POST", "/v2/sandboxes", {"templateID": snap.snapshot_id}, key=other_key), 404)
    assert_error(http("DELETE", f"/templates/{snap.snapshot_id}", key=other_key), 404)
    # Through the SDK too.
    with pytest.raises(NotFoundException):
        Sandbox.connect(sid, api_key=other_key)
    assert sid not in [x.sandbox_id for x in Sandbox.list(api_key=other_key).next_items()]
    # None of that touched it: its own team still has it, running.
    assert s.is_running()
    assert s.commands.run("echo still-here").stdout.strip() == "still-here"
    assert sid in [x.sandbox_id for x in Sandbox.list().next_items()]
    assert snap.snapshot_id in [i.snapshot_id for i in Sandbox.list_snapshots().next_items()]
    Sandbox.delete_snapshot(snap.snapshot_id)


def test_templates_belong_to_the_team_that_builds_them(other_key):
    name = f"iso-tpl-{uuid.uuid4().hex[:8]}"
    code, _, body = http("POST", "/v3/templates", {"name": name})
    assert code == 202, body
    assert http("GET", f"/templates/{name}")[0] == 200
    assert_error(http("GET", f"/templates/{name}", key=other_key), 404)
    assert_error(http("GET", f"/templates/{name}/tags", key=other_key), 404)
    assert_error(http("GET", f"/templates/aliases/{name}", key=other_key), 404)
    assert_error(http("POST", "/v2/sandboxes", {"templateID": name}, key=other_key), 404)
    # The name is taken: the other team cannot build over it.
    assert_error(http("POST", "/v3/templates", {"name": name}, key=other_key), 409)
    # Base templates are shared.
    code, _, body = http("GET", "/templates", key=other_key)
    assert code == 200 and name not in body.decode()
    assert "base" in body.decode()
    # Another team's template cannot be built from either: it is unknown.
    code, _, body = http("POST", "/v3/templates", {"name": name + "-mine"}, key=other_key)
    assert code == 202, body
    build_id = json.loads(body)["buildID"]
    err = assert_error(http("POST", f"/v2/templates/{name}-mine/builds/{build_id}",
                            {"fromTemplate": name, "steps": []}, key=other_key), 400)
    assert "not found" in err["message"], err
    # Shared templates are the operator's (the default team's): another
    # team uses them but does not delete, re-tag or build over them.
    assert_error(http("DELETE", "/templates/base", key=other_key), 403)
    assert_error(http("POST", "/templates/tags", {"target": "base", "tags": ["mine"]}, key=other_key), 403)
    assert_error(http("DELETE", "/templates/tags", {"name": "base", "tags": ["latest"]}, key=other_key), 403)
    assert_error(http("POST", "/v3/templates", {"name": "base"}, key=other_key), 409)
    assert http("GET", "/templates/base/tags", key=other_key)[0] == 200


def test_team_limits_give_429(limited_key):
    made = []
    try:
        too_big = assert_error(
            http("POST", "/v2/sandboxes", {"templateID": "base", "cpuCount": 2}, key=limited_key), 429
        )
        assert "max_vcpus" in too_big["message"], too_big
        code, _, body = http("POST", "/v2/sandboxes", {"templateID": "base"}, key=limited_key)
        assert code == 201, body
        sid = json.loads(body)["sandboxID"]
        made.append(sid)
        second = assert_error(http("POST", "/v2/sandboxes", {"templateID": "base"}, key=limited_key), 429)
        assert "team limited" in second["message"] and "max_sandboxes" in second["message"], second
        assert_error(http("POST", f"/sandboxes/{sid}/fork", {"count": 1}, key=limited_key), 429)
        # Snapshots: the first fits under the byte limit, the next does not.
        code, _, body = http("POST", f"/sandboxes/{sid}/snapshots", {}, key=limited_key)
        assert code == 201, body
        snap = json.loads(body)["snapshotID"]
        over = assert_error(http("POST", f"/sandboxes/{sid}/snapshots", {}, key=limited_key), 429)
        assert "max_snapshot_bytes" in over["message"], over
        # Other teams are not limited by it.
        other = new_sandbox()
        other.kill()
        assert http("DELETE", f"/templates/{snap}", key=limited_key)[0] == 204
    finally:
        for sid in made:
            http("DELETE", f"/sandboxes/{sid}", key=limited_key)


def status_of(pid):
    with open(f"/proc/{pid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def cgroup_value(pid, controller, v1_file, v2_file):
    """A cgroup setting of `pid`'s leaf, in either cgroup layout."""
    with open(f"/proc/{pid}/cgroup") as f:
        lines = [l.rstrip("\n").split(":", 2) for l in f]
    for _, ctrls, path in lines:
        if controller in ctrls.split(",") and os.path.exists(f"/sys/fs/cgroup/{controller}"):
            with open(f"/sys/fs/cgroup/{controller}{path}/{v1_file}") as f:
                return path, f.read().strip()
    path = next(p for h, c, p in lines if h == "0")
    with open(f"/sys/fs/cgroup{path}/{v2_file}") as f:
        return path, f.read().strip()


def test_each_qemu_runs_jailed(fresh):
    a, b = fresh(), fresh()
    pa, pb = qemu_pid(a.sandbox_id), qemu_pid(b.sandbox_id)
    sa, sb = status_of(pa), status_of(pb)
    uid_a, uid_b = sa["Uid"].split()[0], sb["Uid"].split()[0]
    assert uid_a != "0" and uid_b != "0" and uid_a != uid_b, (uid_a, uid_b)
    assert sa["Gid"].split()[0] == uid_a
    for st in (sa, sb):
        assert int(st["CapEff"], 16) == 0 and int(st["CapPrm"], 16) == 0, st["CapEff"]
        assert int(st["CapBnd"], 16) == 0, st["CapBnd"]
        assert st["Seccomp"].strip() == "2", st["Seccomp"]
        assert st["NoNewPrivs"].strip() == "1"
    # Its own cgroup leaf, with limits from its shape (1 vCPU, 256 MiB).
    path, quota = cgroup_value(pa, "cpu", "cpu.cfs_quota_us", "cpu.max")
    assert path.endswith(f"/tine/{a.sandbox_id}"), path
    assert quota.split()[0] == "150000", quota
    _, mem = cgroup_value(pa, "memory", "memory.limit_in_bytes", "memory.max")
    assert int(mem) == (256 + 256) << 20, mem
    _, pids = cgroup_value(pa, "pids", "pids.max", "pids.max")
    assert pids == "512"
    with open(f"/proc/{pa}/limits") as f:
        limits = f.read()
    assert [l for l in limits.splitlines() if l.startswith("Max core file size")][0].split()[4] == "0"
    assert [l for l in limits.splitlines() if l.startswith("Max open files")][0].split()[3] == "4096"
    # Its root is its jail: only what it needs, its own VM and nobody else's.
    root = f"/proc/{pa}/root"
    top = set(os.listdir(root))
    assert "usr" in top and "dev" in top and not {"root", "home", "proc", "sys", "boot"} & top, top
    assert os.listdir(root + os.path.join(DATA, "vms")) == [a.sandbox_id]
    assert b.sandbox_id not in os.listdir(root + os.path.join(SHM, "vms"))
    assert not os.path.exists(root + os.path.join(DATA, "tine.db"))
    import stat

    devices = sorted(
        d for d in os.listdir(root + "/dev") if stat.S_ISCHR(os.stat(f"{root}/dev/{d}").st_mode)
    )
    assert devices == ["null", "random", "urandom", "zero"], devices
    # Its files are its own, out of other jails' reach.
    ram_dir = os.path.join(SHM, "vms", a.sandbox_id)
    assert os.stat(ram_dir).st_uid == int(uid_a) and os.stat(ram_dir).st_mode & 0o777 == 0o700
    vm_dir = os.path.join(DATA, "vms", a.sandbox_id)
    assert os.stat(vm_dir).st_uid == 0 and os.stat(vm_dir).st_mode & 0o777 == 0o710
    assert os.stat(os.path.join(vm_dir, "disk.qcow2")).st_mode & 0o777 == 0o600
    assert os.stat(DATA).st_mode & 0o777 == 0o700
    assert os.stat(os.path.join(DATA, "tine.db")).st_mode & 0o777 == 0o600
    # Killing it removes its cgroup.
    a.kill()
    time.sleep(0.5)
    for ctrl in ("cpu", "memory", "pids", ""):
        leaf = os.path.join("/sys/fs/cgroup", ctrl, path.lstrip("/"))
        assert not os.path.exists(leaf), leaf


def answers(s):
    return s.commands.run("echo alive", timeout=120).stdout.strip() == "alive"


@pytest.mark.machinery
def test_hostile_guests_hit_their_own_limits(fresh):
    victim = fresh(timeout=600)
    hog = fresh(timeout=600)
    # A memory hog: the guest's own OOM killer stops it; the guest lives.
    r = hog.commands.run(
        "head -c 2G /dev/zero | tail > /dev/null; echo exit=$?", user="root", timeout=300
    )
    assert "exit=0" not in r.stdout, r.stdout
    assert answers(hog) and answers(victim)
    # Gigabytes to its console: the log keeps at most twice its cap
    # (64 KiB in run.sh's config).
    hog.commands.run(
        "head -c 400000 /dev/urandom | base64 > /dev/ttyS0", user="root", timeout=300
    )
    log = os.path.join(DATA, "vms", hog.sandbox_id, "console.log")
    assert os.path.getsize(log) <= 65536
    assert os.path.getsize(log + ".1") == 65536
    assert answers(victim)
    # A fork bomb: it may take its own guest down, not the other one.
    bomb = fresh(timeout=600)
    bomb.commands.run("bash -c ':(){ :|:& };:' >/dev/null 2>&1 &", user="root", timeout=60)
    time.sleep(10)
    assert answers(victim)
    code, _, _ = http("GET", "/health", key=None)
    assert code == 200
    bomb.kill()
    assert answers(victim)


@pytest.mark.machinery
def test_a_full_disk_is_enospc_in_the_guest(fresh):
    s = fresh(timeout=900)
    r = s.commands.run(
        "dd if=/dev/zero of=/var/fill bs=4M 2>&1; echo exit=$?; df -B1 --output=avail / | tail -1",
        user="root",
        timeout=900,
    )
    out = r.stdout
    assert "No space left on device" in out and "exit=1" in out, out[-500:]
    # The host file stops at the guest's disk (4 GiB) plus qcow2's tables.
    overlay = os.path.join(DATA, "vms", s.sandbox_id, "disk.qcow2")
    assert os.path.getsize(overlay) < (4 << 30) + (64 << 20)
    s.commands.run("rm -f /var/fill", user="root")
    assert answers(s)
