"""Volumes mounted into sandboxes (`volume_mounts`), through the real SDK and
real VMs: two sandboxes share one volume live, the mount survives pause /
resume and fork, writes past the limit fail with ENOSPC in the guest, the
volume cannot be destroyed while mounted, and another team cannot mount it."""

import time
import uuid

import pytest

e2b = pytest.importorskip("e2b")
if not hasattr(e2b, "Volume"):
    pytest.skip("this SDK version has no Volume API", allow_module_level=True)

from e2b import Sandbox, SandboxException, Volume  # noqa: E402

from conftest import new_sandbox  # noqa: E402

MAX = 16 << 20


def name(tag):
    return f"e2e-{tag}-{uuid.uuid4().hex[:8]}"


def eventually(f, want, timeout=20):
    """f() until it returns `want` (NFS attribute caches live a second)."""
    deadline = time.time() + timeout
    got = f()
    while got != want and time.time() < deadline:
        time.sleep(0.3)
        got = f()
    return got


def cat(s, path):
    r = s.commands.run(f"cat {path} 2>/dev/null || true")
    return r.stdout


@pytest.fixture
def vol():
    v = Volume.create(name("mnt"))
    made = []
    yield v, made
    for s in made:
        try:
            s.kill()
        except Exception:
            pass
    # Once nothing mounts it, it goes.
    assert Volume.destroy(v.volume_id) is True


def mounted(made, v, **kw):
    s = new_sandbox(volume_mounts={"/mnt/data": v}, timeout=600, **kw)
    made.append(s)
    return s


def test_two_sandboxes_share_a_volume_live(vol):
    v, made = vol
    v.write_file("/hello.txt", "from the content API")
    a, b = mounted(made, v), mounted(made, v)
    for s in (a, b):
        assert cat(s, "/mnt/data/hello.txt") == "from the content API"
    # A write in one (as `user`, the SDK's default) shows in the other, and
    # through the content API.
    r = a.commands.run("echo from-a > /mnt/data/a.txt && mkdir -p /mnt/data/d/e && stat -c %U /mnt/data/a.txt")
    assert r.stdout.strip() == "user"
    assert eventually(lambda: cat(b, "/mnt/data/a.txt"), "from-a\n") == "from-a\n"
    assert v.read_file("/a.txt") == "from-a\n"
    assert [e.name for e in v.list("/d")] == ["e"]
    # Renames and removals too.
    b.commands.run("mv /mnt/data/a.txt /mnt/data/d/moved.txt && rm /mnt/data/hello.txt")
    assert eventually(lambda: cat(a, "/mnt/data/d/moved.txt"), "from-a\n") == "from-a\n"
    assert eventually(lambda: a.commands.run("ls /mnt/data").stdout.split(), ["d"]) == ["d"]
    # Bigger files, both ways.
    a.commands.run("head -c 3000000 /dev/urandom > /mnt/data/big && sha256sum /mnt/data/big > /tmp/sum")
    want = a.commands.run("cat /tmp/sum").stdout.split()[0]
    got = eventually(lambda: b.commands.run("sha256sum /mnt/data/big").stdout.split()[0], want)
    assert got == want

    # Not destroyed while mounted (409), destroyed once nothing mounts it.
    with pytest.raises(Exception, match="409|mounted"):
        Volume.destroy(v.volume_id)
    assert v.read_file("/d/moved.txt") == "from-a\n"


def test_pause_resume_and_fork_keep_the_mount(vol):
    v, made = vol
    s = mounted(made, v)
    s.commands.run("echo before > /mnt/data/before.txt")
    assert s.pause() is True
    # Paused, it still holds the volume.
    with pytest.raises(Exception, match="409|mounted"):
        Volume.destroy(v.volume_id)
    v.write_file("/while-paused.txt", "written while paused")
    s = Sandbox.connect(s.sandbox_id)
    assert eventually(lambda: cat(s, "/mnt/data/while-paused.txt"), "written while paused") == "written while paused"
    assert cat(s, "/mnt/data/before.txt") == "before\n"
    s.commands.run("echo after > /mnt/data/after.txt")
    assert eventually(lambda: v.read_file("/after.txt"), "after\n") == "after\n"

    kids = s.fork(count=2, timeout=600)
    for k in kids:
        assert not isinstance(k, Exception), k
        made.append(k)
    for i, k in enumerate(kids):
        assert cat(k, "/mnt/data/after.txt") == "after\n"
        k.commands.run(f"echo kid{i} > /mnt/data/kid{i}.txt")
    for i in range(2):
        assert eventually(lambda: cat(s, f"/mnt/data/kid{i}.txt"), f"kid{i}\n") == f"kid{i}\n"


def test_the_limit_is_enospc_in_the_guest(vol):
    v, made = vol
    s = mounted(made, v)
    r = s.commands.run(
        f"dd if=/dev/zero of=/mnt/data/fill bs=1M count={(MAX >> 20) + 4} conv=fsync 2>&1; echo rc=$?",
    )
    assert "No space left on device" in r.stdout or "Disk quota" in r.stdout, r.stdout
    assert "rc=0" not in r.stdout
    s.commands.run("rm -f /mnt/data/fill")
    # The room comes back.
    assert eventually(lambda: s.commands.run("echo ok > /mnt/data/small && cat /mnt/data/small").stdout, "ok\n") == "ok\n"


def test_symlinks_out_of_the_volume_are_not_followed_on_the_host(vol):
    v, made = vol
    s = mounted(made, v)
    s.commands.run("ln -s /etc/hostname /mnt/data/link && ln -s ../../.. /mnt/data/up")
    # The guest follows it in its own file system...
    assert cat(s, "/mnt/data/link").strip() == s.sandbox_id
    # ...the host never does.
    with pytest.raises(Exception, match="400|out of the volume"):
        v.read_file("/link")
    with pytest.raises(Exception, match="400|out of the volume"):
        v.read_file("/up/etc/passwd")


def test_bad_mounts_and_other_teams(vol, other_key):
    v, _ = vol
    with pytest.raises(SandboxException, match="no volume named"):
        Sandbox.create(volume_mounts={"/mnt/x": "no-such-volume"})
    with pytest.raises(SandboxException, match="no volume named"):
        Sandbox.create(volume_mounts={"/mnt/x": v.name}, api_key=other_key)
    for bad in ["relative", "/", "/proc/x", "/mnt/../etc"]:
        with pytest.raises(SandboxException, match="volumeMounts"):
            Sandbox.create(volume_mounts={bad: v})
