"""A full disk during a pause (issue "Crash consistency"): a second host
whose data dir is a small tmpfs fills up while a sandbox pauses. The
request gets 507, the sandbox keeps running with its memory and files, no
half-written capture is left, and once there is room it pauses and resumes
as usual."""

import json
import os
import subprocess
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
    h = Host("e2e-full-disk", 16 << 20)
    config = open(h.config).read()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SIZE},mode=0700", "tmpfs", h.dir], check=True)
    try:
        base = os.path.dirname(os.environ["TINE_DATA_DIR"])
        os.symlink(os.path.join(base, "current"), os.path.join(h.dir, "current"))
        with open(h.config, "w") as f:
            f.write(config)
        h.serve()
        yield h
    finally:
        if h.server is not None:
            h.server.terminate()
            h.server.wait(timeout=30)
            h.server = None
        h.stop_vms()
        subprocess.run(["umount", "-l", h.dir], check=False)
        h.close()


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
            # Still running, memory and all; no half-written capture left.
            assert sbx.is_running()
            assert sbx.commands.run("sha256sum < /dev/shm/blob", user="root").stdout.split()[0] == blob
            assert set(os.listdir(snapshots)) == before
            status, body = raw(h, "GET", f"/sandboxes/{sbx.sandbox_id}")
            assert status == 200 and json.loads(body)["state"] == "running", body[:300]

            # With room again, it pauses and resumes as usual.
            os.remove(filler)
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
