"""P11 of `tine bench`: an RL rollout through the real E2B Python SDK.

A branching episode: create a sandbox from the template, run steps 1-3,
fork it into BRANCHES children at step 3 (the fork captures it), then the
trunk runs steps 4-5 while each child runs 2 steps of its own, all at
once; every sandbox is killed at the end. Its baseline, the same episode
in one sandbox: create, steps 1-5, then the branches' 2 steps each one
after another, kill. A step writes a file through the SDK (files.write)
and runs a command that reads it and appends to the episode's log.

EPISODES episodes run at once in each phase. Reads E2B_API_URL,
E2B_SANDBOX_URL, E2B_API_KEY, TINE_BENCH_EPISODES, TINE_BENCH_BRANCHES;
prints one JSON object: per phase the episode wall times and step
latencies (ms), the fork and create latencies (ms), the phase's wall time
and the host's CPU seconds over it (all processes: server, QEMUs, this
client), and the errors. Kills every sandbox it made, whatever happened.
"""

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from e2b import Sandbox

EPISODES = int(os.environ["TINE_BENCH_EPISODES"])
BRANCHES = int(os.environ["TINE_BENCH_BRANCHES"])
TICK = os.sysconf("SC_CLK_TCK")
made = []
lock = threading.Lock()


def host_cpu_seconds():
    """Busy CPU time of the whole host (user, nice, system, irq, softirq, steal)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / TICK


def timed(fn, into):
    t = time.perf_counter()
    r = fn()
    into.append((time.perf_counter() - t) * 1e3)
    return r


def step(s, n, steps):
    def run():
        s.files.write(f"/tmp/step-{n}", os.urandom(4096))
        r = s.commands.run(f"sha256sum /tmp/step-{n} >> /tmp/episode.log && wc -l < /tmp/episode.log",
                           timeout=600, request_timeout=900)
        if r.exit_code != 0:
            raise RuntimeError(f"step {n} exited {r.exit_code}: {r.stderr!r}")
    timed(run, steps)


def create(out):
    s = timed(lambda: Sandbox.create(template="base", timeout=1800, metadata={"tine-bench": "p11"},
                                     request_timeout=900), out["create"])
    with lock:
        made.append(s)
    return s


def kill(s):
    try:
        s.kill()
    except Exception:
        pass


def branching(out):
    t = time.perf_counter()
    trunk = create(out)
    for n in (1, 2, 3):
        step(trunk, n, out["steps"])
    children = timed(lambda: trunk.fork(count=BRANCHES, timeout=1800, request_timeout=900), out["fork"])
    with lock:
        made.extend(children)

    def trunk_rest():
        for n in (4, 5):
            step(trunk, n, out["steps"])

    def branch(i, c):
        for n in (1, 2):
            step(c, f"b{i}-{n}", out["steps"])

    with ThreadPoolExecutor(BRANCHES + 1) as pool:
        futures = [pool.submit(trunk_rest)] + [pool.submit(branch, i, c) for i, c in enumerate(children)]
        for f in futures:
            f.result()
    for s in [trunk, *children]:
        kill(s)
    out["episode"].append((time.perf_counter() - t) * 1e3)


def straight(out):
    t = time.perf_counter()
    s = create(out)
    for n in (1, 2, 3, 4, 5):
        step(s, n, out["steps"])
    for i in range(BRANCHES):
        for n in (1, 2):
            step(s, f"b{i}-{n}", out["steps"])
    kill(s)
    out["episode"].append((time.perf_counter() - t) * 1e3)


def phase(episode):
    out = {"episode": [], "steps": [], "fork": [], "create": [], "errors": []}
    cpu, t = host_cpu_seconds(), time.perf_counter()
    with ThreadPoolExecutor(EPISODES) as pool:
        for f in [pool.submit(episode, out) for _ in range(EPISODES)]:
            try:
                f.result()
            except Exception as e:  # noqa: BLE001 (reported, not raised)
                out["errors"].append(f"{type(e).__name__}: {e}")
    out["wall_s"] = time.perf_counter() - t
    out["cpu_s"] = host_cpu_seconds() - cpu
    return out


result = {}
try:
    # One episode unmeasured first, so neither phase starts cold.
    straight({"episode": [], "steps": [], "fork": [], "create": [], "errors": []})
    result["straight"] = phase(straight)
    result["branching"] = phase(branching)
finally:
    with lock:
        for s in made:
            kill(s)
print(json.dumps(result))
