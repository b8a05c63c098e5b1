"""`tine sandbox …` against the server (issue "Templates as warm
snapshots; pause, resume, snapshots and fork": `tine sandbox fork ID -n 16`)."""

import os
import subprocess

from e2b import Sandbox, SandboxState

from conftest import API, API_KEY


def tine(*args, key=API_KEY):
    env = dict(os.environ, E2B_API_URL=API, E2B_API_KEY=key, RUST_BACKTRACE="0")
    return subprocess.run([os.environ["TINE_BIN"], "sandbox", *args], capture_output=True, text=True, timeout=600, env=env)


def test_cli_fork_pause_resume_snapshot_kill(fresh):
    s = fresh(timeout=600)
    s.files.write("/home/user/from-parent", "yes")

    p = tine("fork", s.sandbox_id, "-n", "3", "--timeout", "600")
    assert p.returncode == 0, p.stderr
    kids = p.stdout.split()
    assert len(kids) == 3 and len(set(kids)) == 3
    try:
        for k in kids:
            child = Sandbox.connect(k)
            assert child.files.read("/home/user/from-parent") == "yes"
        listed = tine("list")
        assert listed.returncode == 0, listed.stderr
        for k in kids + [s.sandbox_id]:
            assert k in listed.stdout

        snap = tine("snapshot", s.sandbox_id)
        assert snap.returncode == 0 and snap.stdout.strip().startswith("snap-"), snap.stderr
        Sandbox.delete_snapshot(snap.stdout.strip())

        assert tine("pause", s.sandbox_id).returncode == 0
        assert Sandbox.get_info(s.sandbox_id).state == SandboxState.PAUSED
        assert tine("resume", s.sandbox_id).returncode == 0
        assert Sandbox.connect(s.sandbox_id).files.read("/home/user/from-parent") == "yes"
    finally:
        killed = tine("kill", *kids)
    assert killed.returncode == 0, killed.stderr
    for k in kids:
        assert k not in tine("list").stdout


def test_cli_errors_are_clear(sbx):
    p = tine("fork", "nope", "-n", "2")
    assert p.returncode != 0 and "404" in p.stderr and "nope" in p.stderr
    p = tine("list", key="")
    assert p.returncode != 0 and "E2B_API_KEY is not set" in p.stderr
    p = tine("list", key="wrong")
    assert p.returncode != 0 and "401" in p.stderr
    # (An unknown sandbox is 404 before its body is read.)
    p = tine("fork", sbx.sandbox_id, "-n", "0")
    assert p.returncode != 0 and "400" in p.stderr
