"""P13 of `tine bench`: captures through a cluster's registry.

Through the real E2B Python SDK and the nodes' API (with the cluster
secret, as a gateway calls them), on a cluster of 3 nodes with a registry:

- a snapshot of a sandbox that wrote MEM_MIB to memory and to disk: the
  first create from it on a node that never saw it, reading it lazily
  (the default), and on another restarted with `lazy_pull = false`
  (fetched whole first), against creates on the node that made it, and
  the bytes each fetched (the nodes' /metrics: the image cache's fetched
  bytes and the eager pulls') against the capture's size;
- a paused sandbox resumed on another node (its pause capture adopted,
  as a gateway does when the sandbox's node is down) against a resume on
  its own node, N times;
- the background push of a pause capture after the sandbox wrote
  WRITE_MIB to its disk: from the pause's answer until the catalog names
  the capture.

Reads E2B_API_URL (the gateway), E2B_API_KEY, TINE_BENCH_NODES,
TINE_BENCH_SECRET, TINE_BENCH_N, TINE_BENCH_MEM_MIB, TINE_BENCH_WRITE_MIB,
TINE_BIN, TINE_POSTGRES_URL and TINE_BENCH_CLUSTER_SH (with the
TINE_CLUSTER_* variables it needs); prints one JSON object (ms, bytes).
Kills every sandbox it made and deletes its snapshot.
"""

import json
import os
import re
import subprocess
import time

import httpx
from e2b import Sandbox

GATEWAY = os.environ["E2B_API_URL"]
KEY = os.environ["E2B_API_KEY"]
NODES = os.environ["TINE_BENCH_NODES"].split(",")
NODE_HEADERS = {"x-tine-cluster-secret": os.environ["TINE_BENCH_SECRET"], "x-tine-team": "default"}
N = int(os.environ["TINE_BENCH_N"])
MEM_MIB = int(os.environ["TINE_BENCH_MEM_MIB"])
WRITE_MIB = int(os.environ["TINE_BENCH_WRITE_MIB"])
made = []
out = {
    "create_first": [], "create_holder": [], "fetched_bytes": [], "capture_bytes": 0,
    "create_whole": [], "whole_bytes": [],
    "resume_moved": [], "resume_local": [], "push_ms": [], "push_bytes": [], "errors": [],
}


def timed(f):
    t = time.perf_counter()
    r = f()
    return r, (time.perf_counter() - t) * 1000


def api(method, path, base=GATEWAY, headers=None, **kw):
    h = headers or {"X-API-KEY": KEY}
    return httpx.request(method, base + path, headers=h, timeout=300, **kw)


def node_url(node_id):
    return NODES[int(node_id.split("-")[1]) - 1]


def node_of(sid):
    return api("GET", f"/sandboxes/{sid}").json()["nodeID"]


def captures():
    """{capture id: MiB its push sent} from `tine cluster captures`."""
    p = subprocess.run([os.environ["TINE_BIN"], "cluster", "captures"], capture_output=True, text=True, check=True)
    rows = [line.split() for line in p.stdout.splitlines()[1:] if line.strip()]
    return {r[0]: r[3] for r in rows}


def wait_capture(pred, limit=600):
    deadline = time.time() + limit
    while True:
        found = [i for i in captures() if pred(i)]
        if found:
            return found[0]
        if time.time() > deadline:
            raise TimeoutError("the capture was not pushed")
        time.sleep(0.05)


def fetched_bytes(node):
    """What `node` fetched from registries: captures pulled whole, and the
    chunks its image daemon fetched (lazily read captures, images)."""
    text = httpx.get(node + "/metrics", headers=NODE_HEADERS, timeout=30).text
    total = 0
    for pattern in (r'^tine_cluster_capture_bytes\{kind="pulled"\} (\d+)', r'^tine_image_cache_bytes\{kind="fetched"\} (\d+)'):
        m = re.search(pattern, text, re.M)
        total += int(m.group(1)) if m else 0
    return total


def restart(node, lazy):
    """Restart `node`'s server reading pulled captures lazily or not."""
    idx = str(NODES.index(node) + 1)
    env = dict(os.environ, TINE_CLUSTER_LAZY_PULL="true" if lazy else "false")
    for step in ("term-node", "start-node"):
        subprocess.run(["bash", os.environ["TINE_BENCH_CLUSTER_SH"], step, idx], env=env, check=True, capture_output=True, timeout=300)


def on_node(node, **kw):
    return Sandbox.create(api_url=node, sandbox_url=node, headers=NODE_HEADERS, timeout=600, **kw)


def write(sb, mem_mib, disk_mib):
    sb.commands.run(
        f"head -c {mem_mib << 20} /dev/urandom > /dev/shm/blob; "
        f"head -c {disk_mib << 20} /dev/urandom > /home/user/big; sync",
        timeout=600,
    )


snap = None
try:
    # First creates from a snapshot: on its node, then on each other node.
    src = Sandbox.create(api_url=GATEWAY, sandbox_url=GATEWAY, timeout=600)
    made.append(src.sandbox_id)
    write(src, MEM_MIB, MEM_MIB)
    holder = node_url(node_of(src.sandbox_id))
    snap = src.create_snapshot().snapshot_id
    wait_capture(lambda i: i == snap)
    for _ in range(2):
        sb, ms = timed(lambda: on_node(holder, template=snap))
        made.append(sb.sandbox_id)
        out["create_holder"].append(ms)
    lazy, whole = [n for n in NODES if n != holder]
    restart(whole, lazy=False)
    for node, times, fetched in ((lazy, "create_first", "fetched_bytes"), (whole, "create_whole", "whole_bytes")):
        before = fetched_bytes(node)
        sb, ms = timed(lambda: on_node(node, template=snap))
        made.append(sb.sandbox_id)
        out[times].append(ms)
        # The image daemon writes its counters every second.
        time.sleep(2)
        out[fetched].append(fetched_bytes(node) - before)
    restart(whole, lazy=True)
    # The capture's size: what its push sent (a fresh registry has none of
    # its chunks but those shared with the base image's captures).
    out["capture_bytes"] = int(float(captures().get(snap, "0")) * (1 << 20))

    # Resumes: on its own node, and moved to the next node.
    sb = Sandbox.create(api_url=GATEWAY, sandbox_url=GATEWAY, timeout=600)
    made.append(sb.sandbox_id)
    write(sb, 8, 0)
    sid = sb.sandbox_id
    for i in range(N):
        assert sb.pause() is True
        r, ms = timed(lambda: api("POST", f"/sandboxes/{sid}/connect", json={"timeout": 600}))
        assert r.status_code == 201, r.text
        out["resume_local"].append(ms)
        # The capture of this pause, not one of an earlier pause that its
        # node has not forgotten yet.
        seen = set(captures())
        assert sb.pause() is True
        wait_capture(lambda c: c.startswith(f"p-{sid}-") and c not in seen)
        here = node_of(sid)
        there = NODES[(NODES.index(node_url(here)) + 1) % len(NODES)]
        h = dict(NODE_HEADERS, **{"x-tine-adopt": "1"})
        r, ms = timed(lambda: api("POST", f"/sandboxes/{sid}/connect", base=there, headers=h, json={"timeout": 600}))
        assert r.status_code == 201, r.text
        out["resume_moved"].append(ms)
        # The gateway learns where it went as it does after its own moves.
        deadline = time.time() + 30
        while node_url(node_of(sid)) != there and time.time() < deadline:
            time.sleep(0.1)

    # The background push of a pause capture after writing WRITE_MIB.
    for _ in range(min(N, 2)):
        sb = Sandbox.create(api_url=GATEWAY, sandbox_url=GATEWAY, timeout=600)
        made.append(sb.sandbox_id)
        write(sb, 0, WRITE_MIB)
        assert sb.pause() is True
        t = time.perf_counter()
        wait_capture(lambda c, s=sb.sandbox_id: c.startswith(f"p-{s}-"))
        out["push_ms"].append((time.perf_counter() - t) * 1000)
except Exception as e:  # reported as the rows' error
    out["errors"].append(f"{type(e).__name__}: {e}")
finally:
    for s in made:
        try:
            api("DELETE", f"/sandboxes/{s}")
        except Exception as e:
            out["errors"].append(f"kill {s}: {e}")
    if snap:
        api("DELETE", f"/templates/{snap}")
print(json.dumps(out))
