"""P6 of `tine bench`: creates and commands.run("echo") through the real E2B
Python SDK, first one at a time, then all at once.

Reads E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY, TINE_BENCH_CONCURRENCY and
TINE_BENCH_SEQUENTIAL; prints one JSON object with the latencies in ms and
the errors. Kills every sandbox it made, whatever happened.
"""

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from e2b import Sandbox

N = int(os.environ["TINE_BENCH_CONCURRENCY"])
SEQ = int(os.environ["TINE_BENCH_SEQUENTIAL"])
made = []
lock = threading.Lock()
result = {
    "sequential_create": [],
    "sequential_run": [],
    "concurrent_create": [],
    "concurrent_run": [],
    "errors": [],
}


def create():
    t = time.perf_counter()
    s = Sandbox.create(template="base", timeout=1800, metadata={"tine-bench": "p6"}, request_timeout=900)
    took = (time.perf_counter() - t) * 1e3
    with lock:
        made.append(s)
    return s, took


def run(s):
    t = time.perf_counter()
    r = s.commands.run("echo", timeout=600, request_timeout=900)
    took = (time.perf_counter() - t) * 1e3
    if r.exit_code != 0:
        raise RuntimeError(f"echo exited {r.exit_code}: {r.stderr!r}")
    return took


def kill(s):
    try:
        s.kill()
    except Exception as e:  # noqa: BLE001 - reported, not raised
        result["errors"].append(f"kill {s.sandbox_id}: {e!r}")


try:
    for _ in range(SEQ):
        s, took = create()
        result["sequential_create"].append(took)
        result["sequential_run"].append(run(s))
        kill(s)
        made.remove(s)
    with ThreadPoolExecutor(max_workers=N) as ex:
        sandboxes = []
        for f in [ex.submit(create) for _ in range(N)]:
            try:
                s, took = f.result()
                sandboxes.append(s)
                result["concurrent_create"].append(took)
            except Exception as e:  # noqa: BLE001
                result["errors"].append(f"create: {e!r}")
        for f in [ex.submit(run, s) for s in sandboxes]:
            try:
                result["concurrent_run"].append(f.result())
            except Exception as e:  # noqa: BLE001
                result["errors"].append(f"commands.run: {e!r}")
except Exception as e:  # noqa: BLE001
    result["errors"].append(f"{e!r}")
finally:
    with ThreadPoolExecutor(max_workers=8) as ex:
        list(ex.map(kill, list(made)))
    print(json.dumps(result))
