"""A node in a podman container behind gateways, with the real E2B SDK.

Run by tests/deploy/podman-node.sh, which starts PostgreSQL and gateway 1
on the host (scripts/cluster.sh), gateway 2 and the node ("podman-1") in
containers of the image deploy/image/build.sh makes, and sets:

  E2B_API_URL, E2B_SANDBOX_URL  gateway 1 (on the host)
  E2B_API_KEY                   a key from `tine cluster create-key`
  TINE_E2E_GATEWAY2             gateway 2 (in a container)
  TINE_E2E_NODE_ID              podman-1
  TINE_E2E_NODE_DIR             the node's data dir (host path = container path)
  TINE_E2E_CGROUP_PARENT        the node's [jail] cgroup_parent
  TINE_E2E_UID_BASE             the node's [jail] uid_base
  TINE_E2E_PODMAN_EXEC          JSON: the argv prefix of `podman exec` into the node
  TINE_E2E_SURVIVOR_FILE        where the last test writes the id of a sandbox it
                                leaves running, for the stop that follows
"""

import json
import os
import subprocess
import time

import httpx
import pytest
from e2b import CommandExitException, Sandbox

GATEWAY = os.environ["E2B_API_URL"]
GATEWAY2 = os.environ["TINE_E2E_GATEWAY2"]
KEY = os.environ["E2B_API_KEY"]
NODE_ID = os.environ["TINE_E2E_NODE_ID"]
NODE_DIR = os.environ["TINE_E2E_NODE_DIR"]
CGROUP_PARENT = os.environ["TINE_E2E_CGROUP_PARENT"]
UID_BASE = int(os.environ["TINE_E2E_UID_BASE"])
PODMAN_EXEC = json.loads(os.environ["TINE_E2E_PODMAN_EXEC"])


def get(gateway, sandbox_id):
    return httpx.get(f"{gateway}/sandboxes/{sandbox_id}", headers={"X-API-KEY": KEY}, timeout=60)


def qemu_pids_on_host():
    """QEMU processes of this node, as the host sees them."""
    out = subprocess.run(["pgrep", "-f", f"qemu-system.*{NODE_DIR}"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


@pytest.fixture(scope="module")
def sandbox():
    s = Sandbox.create(timeout=300, metadata={"test": "podman-node"})
    yield s
    try:
        s.kill()
    except Exception:
        pass


def test_the_gateways_place_it_on_the_podman_node(sandbox):
    for gw in (GATEWAY, GATEWAY2):
        r = get(gw, sandbox.sandbox_id)
        assert r.status_code == 200, (gw, r.status_code, r.text)
        body = r.json()
        assert body["nodeID"] == NODE_ID, (gw, body)
        assert body["sandboxID"] == sandbox.sandbox_id, body


def test_its_vm_runs_inside_the_container(sandbox):
    # The node runs no warm pool (pool_size = 0): this QEMU is the sandbox's.
    pids = qemu_pids_on_host()
    assert pids, f"no QEMU under {NODE_DIR} on the host"
    host_pidns = os.readlink("/proc/self/ns/pid")
    for pid in pids:
        assert os.readlink(f"/proc/{pid}/ns/pid") != host_pidns, f"QEMU {pid} is in the host's PID namespace"
    inside = subprocess.run([*PODMAN_EXEC, "pgrep", "-c", "qemu-system"], capture_output=True, text=True)
    assert inside.returncode == 0 and int(inside.stdout) >= 1, (inside.returncode, inside.stdout, inside.stderr)


def test_its_qemu_is_jailed_from_inside_the_container(sandbox):
    """The jail works in the container: QEMU runs as a uid of the node's
    range and sits in a cgroup leaf under the node's parent in the host's
    hierarchy (the container mounts the host's /sys/fs/cgroup)."""
    pids = qemu_pids_on_host()
    assert pids
    for pid in pids:
        with open(f"/proc/{pid}/status") as f:
            uids = next(l.split()[1:] for l in f if l.startswith("Uid:"))
        assert all(UID_BASE <= int(u) < UID_BASE + 65536 for u in uids), (pid, uids)
        with open(f"/proc/{pid}/cgroup") as f:
            cgroups = f.read()
        leaves = [l for l in cgroups.splitlines() if f"/{CGROUP_PARENT}/" in l]
        assert any(":memory:" in l for l in leaves) and any(":pids:" in l for l in leaves), cgroups


def test_commands_and_files_through_the_host_gateway(sandbox):
    r = sandbox.commands.run("echo hello from podman-1; id -un")
    assert r.exit_code == 0, r
    assert r.stdout.splitlines() == ["hello from podman-1", "user"], r.stdout
    sandbox.files.write("/tmp/podman-node.txt", "written through gateway 1")
    assert sandbox.files.read("/tmp/podman-node.txt") == "written through gateway 1"
    # A failing command is reported, not hidden.
    with pytest.raises(CommandExitException) as e:
        sandbox.commands.run("echo out; exit 7")
    assert e.value.exit_code == 7 and e.value.stdout == "out\n", e.value


def test_the_same_sandbox_through_the_gateway_container(sandbox):
    other = Sandbox.connect(sandbox.sandbox_id, api_url=GATEWAY2, sandbox_url=GATEWAY2)
    assert other.files.read("/tmp/podman-node.txt") == "written through gateway 1"
    r = other.commands.run("cat /tmp/podman-node.txt; echo; echo via gateway 2 > /tmp/g2.txt")
    assert r.stdout.splitlines()[0] == "written through gateway 1", r.stdout
    assert sandbox.files.read("/tmp/g2.txt") == "via gateway 2\n"


def test_kill_ends_it(sandbox):
    sandbox.kill()
    for gw in (GATEWAY, GATEWAY2):
        r = get(gw, sandbox.sandbox_id)
        assert r.status_code == 404, (gw, r.status_code, r.text)
    # The node runs no warm pool (pool_size = 0): its last QEMU goes.
    deadline = time.monotonic() + 30
    while qemu_pids_on_host() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not qemu_pids_on_host(), "the killed sandbox's QEMU is still running"


def test_a_sandbox_left_running_for_the_stop():
    """Left running: podman-node.sh then stops the container and checks that
    its QEMU went with it (a node's sandboxes end with its container)."""
    s = Sandbox.create(timeout=300, metadata={"test": "podman-node-survivor"})
    assert s.commands.run("echo up").stdout == "up\n"
    assert get(GATEWAY, s.sandbox_id).json()["nodeID"] == NODE_ID
    assert qemu_pids_on_host(), "the running sandbox has no QEMU"
    with open(os.environ["TINE_E2E_SURVIVOR_FILE"], "w") as f:
        f.write(s.sandbox_id)
