"""P14 of `tine bench`: a volume mounted into a sandbox against the
sandbox's own disk, through the real E2B Python SDK.

Creates a volume and a sandbox that mounts it at /mnt/vol, then, ITERATIONS
times and alternating which goes first, runs the same Python program in
the guest (as root) on the volume and on the own disk (/root/p14): write MIB
MiB sequentially (1 MiB writes, then fsync), drop the guest's page cache and
read it back, then create FILES files of 1 KiB (each opened, written,
closed) and sync. Reads E2B_API_URL, E2B_SANDBOX_URL, E2B_VOLUME_API_URL,
E2B_API_KEY, TINE_BENCH_MIB, TINE_BENCH_FILES, TINE_BENCH_ITERATIONS;
prints one JSON object with per-run MiB/s and files/s for each, and the
errors. Removes the sandbox and the volume, whatever happened.
"""

import json
import os
import uuid

from e2b import Sandbox, Volume

MIB = int(os.environ["TINE_BENCH_MIB"])
FILES = int(os.environ["TINE_BENCH_FILES"])
ITERATIONS = int(os.environ["TINE_BENCH_ITERATIONS"])

GUEST = r'''
import json, os, shutil, sys, time
d, mib, files = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.makedirs(d, exist_ok=True)
p = os.path.join(d, "seq")
buf = os.urandom(1 << 20)
t = time.perf_counter()
with open(p, "wb") as f:
    for _ in range(mib):
        f.write(buf)
    f.flush()
    os.fsync(f.fileno())
w = time.perf_counter() - t
os.sync()
with open("/proc/sys/vm/drop_caches", "w") as f:
    f.write("3")
t = time.perf_counter()
n = 0
with open(p, "rb", buffering=0) as f:
    while True:
        b = f.read(1 << 20)
        if not b:
            break
        n += len(b)
r = time.perf_counter() - t
assert n == mib << 20, n
small = os.path.join(d, "small")
os.makedirs(small)
t = time.perf_counter()
for i in range(files):
    with open(os.path.join(small, f"f{i}"), "wb") as f:
        f.write(b"x" * 1024)
os.sync()
c = time.perf_counter() - t
os.remove(p)
shutil.rmtree(small)
print(json.dumps({"write": mib / w, "read": mib / r, "creates": files / c}))
'''

out = {"volume": [], "disk": [], "errors": []}
vol = Volume.create(f"bench-p14-{uuid.uuid4().hex[:8]}")
sbx = None
try:
    sbx = Sandbox.create(volume_mounts={"/mnt/vol": vol}, timeout=1800)
    sbx.files.write("/tmp/p14.py", GUEST)
    places = [("volume", "/mnt/vol/p14"), ("disk", "/root/p14")]
    for i in range(ITERATIONS):
        for key, d in places if i % 2 == 0 else places[::-1]:
            try:
                r = sbx.commands.run(
                    f"python3 /tmp/p14.py {d} {MIB} {FILES}", user="root", timeout=1200
                )
                out[key].append(json.loads(r.stdout.strip().splitlines()[-1]))
            except Exception as e:  # noqa: BLE001 (reported, not raised)
                out["errors"].append(f"{key}: {e}")
except Exception as e:  # noqa: BLE001
    out["errors"].append(str(e))
finally:
    if sbx is not None:
        try:
            sbx.kill()
        except Exception as e:  # noqa: BLE001
            out["errors"].append(f"kill: {e}")
    try:
        Volume.destroy(vol.volume_id)
    except Exception as e:  # noqa: BLE001
        out["errors"].append(f"destroy: {e}")
print(json.dumps(out))
