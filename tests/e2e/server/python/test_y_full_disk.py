"""A full disk during a pause (issue "Crash consistency"): a second host
whose data dir is a small loop-mounted ext4 fills up while a sandbox
pauses. (Not a tmpfs: a guest touching RAM it never touched before makes
a full tmpfs allocate, and QEMU dies of SIGBUS.) The
request gets 507, the sandbox keeps running with its memory and files, no
half-written capture is left, and once there is room it pauses and resumes
as usual."""

import json
import os
import shutil
import sqlite3
import subprocess
import time
import urllib.error
import urllib.request

import pytest
from e2b import Sandbox

from test_y_lazy import Host

SIZE = "768m"


def raw(host, method, path):
    req = urllib.request.Request(f"http://127.0.0.1:{host.port}{path}", data=b"{}", method=method,
                                 headers={"X-API-KEY": host.key, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture()
def small_host():
    stale = os.path.join(os.path.dirname(os.environ["TINE_DATA_DIR"]), "e2e-full-disk")
    if os.path.ismount(stale):  # (an earlier run that was cut short)
        subprocess.run(["umount", "-l", stale], check=False)
    h = Host("e2e-full-disk", 16 << 20)
    config = open(h.config).read()
    image = h.dir + ".img"
    subprocess.run(["truncate", "-s", SIZE, image], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", image], check=True)
    subprocess.run(["mount", "-o", "loop", image, h.dir], check=True)
    os.chmod(h.dir, 0o700)
    try:
        base = os.path.dirname(os.environ["TINE_DATA_DIR"])
        os.symlink(os.path.join(base, "current"), os.path.join(h.dir, "current"))
        with open(h.config, "w") as f:
            # Starts are refused below 64 MiB free (507).
            f.write("min_free_disk_mb = 64\n" + config)
        h.serve()
        yield h
    finally:
        # Kept for a look after a failure (the file system goes).
        subprocess.run("rm -rf /tmp/tine-e2e-full-disk && mkdir -p /tmp/tine-e2e-full-disk && "
                       f"cp {h.dir}/tine.db* {h.dir}/server.log /tmp/tine-e2e-full-disk/; "
                       f"for d in {h.dir}/vms/*; do cp $d/console.log /tmp/tine-e2e-full-disk/$(basename $d).console; done",
                       shell=True, check=False)
        if h.server is not None:
            h.server.terminate()
            h.server.wait(timeout=30)
            h.server = None
        # (Stops its VMs and image daemon, which hold files on the mount.)
        h.close()
        subprocess.run(["umount", "-l", h.dir], check=False)
        os.remove(image)
        shutil.rmtree(h.dir, ignore_errors=True)


def free_bytes(path):
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def test_a_pause_on_a_full_disk_keeps_the_sandbox(small_host):
    h = small_host
    with h.sdk():
        sbx = Sandbox.create(timeout=600)
        try:
            put = sbx.commands.run("head -c 64M /dev/urandom > /dev/shm/blob && sha256sum < /dev/shm/blob",
                                   user="root", timeout=300)
            blob = put.stdout.split()[0]
            snapshots = os.path.join(h.dir, "snapshots")
            before = set(os.listdir(snapshots))

            # Leave 8 MiB: the pause's RAM layer (64 MiB of changed pages)
            # does not fit.
            filler = os.path.join(h.dir, "filler")
            with open(filler, "wb") as f:
                os.posix_fallocate(f.fileno(), 0, free_bytes(h.dir) - (8 << 20))
            status, body = raw(h, "POST", f"/sandboxes/{sbx.sandbox_id}/pause")
            assert status == 507, body[:300]
            doc = json.loads(body)
            assert doc["code"] == 507 and "keeps running" in doc["message"], doc
            # No new VM is started on a nearly full disk, with a clear error.
            status, body = raw(h, "POST", "/sandboxes")
            assert status == 507 and "min_free_disk_mb" in json.loads(body)["message"], body[:300]
            # Still running, memory and all; no half-written capture left.
            assert sbx.is_running()
            assert sbx.commands.run("sha256sum < /dev/shm/blob", user="root").stdout.split()[0] == blob
            assert set(os.listdir(snapshots)) == before
            status, body = raw(h, "GET", f"/sandboxes/{sbx.sandbox_id}")
            assert status == 200 and json.loads(body)["state"] == "running", body[:300]

            # A guest write the host has no room for: QEMU stops the guest
            # (io-error); once there is room, the server notices, says so
            # and lets it run again; the write completes.
            write = sbx.commands.run(
                "dd if=/dev/urandom of=/var/tmp/big bs=1M count=24 conv=fsync 2>&1; sha256sum /var/tmp/big",
                user="root", background=True)
            time.sleep(15)
            os.remove(filler)
            done = write.wait()
            assert done.exit_code == 0, done
            assert sbx.commands.run("stat -c %s /var/tmp/big").stdout.strip() == str(24 << 20)
            with sqlite3.connect(f"file:{h.dir}/tine.db?mode=ro", uri=True) as db:
                kinds = [r[0] for r in db.execute(
                    "SELECT detail FROM events WHERE sandbox_id = ? AND kind = 'guest_stopped'",
                    (sbx.sandbox_id,))]
            assert kinds and "io-error" in kinds[0], kinds
            sbx.commands.run("rm -f /var/tmp/big && fstrim -a || true", user="root")

            # With room again, it pauses and resumes as usual.
            sbx.pause()
            status, body = raw(h, "GET", f"/sandboxes/{sbx.sandbox_id}")
            assert status == 200 and json.loads(body)["state"] == "paused", body[:300]
            again = Sandbox.connect(sbx.sandbox_id)
            assert again.commands.run("sha256sum < /dev/shm/blob", user="root").stdout.split()[0] == blob
        finally:
            try:
                Sandbox.kill(sbx.sandbox_id)
            except Exception:
                pass
