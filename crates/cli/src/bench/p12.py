"""P12 of `tine bench`: a cluster's gateway against one of its nodes.

Through the real E2B Python SDK: N creates (one at a time) through the
gateway and N straight to the nodes in turn (their API with the cluster
secret, as a gateway calls it), each after a pause of a second so that
both find the nodes' warm pools refilled; then CALLS commands.run("true") in one sandbox through the
gateway and as many through its node's own proxy (a sandbox made through
the gateway); then SPREAD creates
through the gateway, counted by the node each landed on. Reads
E2B_API_URL (the gateway), E2B_API_KEY, TINE_BENCH_NODES (the nodes' URLs),
TINE_BENCH_SECRET, TINE_BENCH_N, TINE_BENCH_CALLS, TINE_BENCH_SPREAD;
prints one JSON object (latencies in ms). Kills every sandbox it made.
"""

import json
import os
import time

import httpx
from e2b import Sandbox

GATEWAY = os.environ["E2B_API_URL"]
KEY = os.environ["E2B_API_KEY"]
NODES = os.environ["TINE_BENCH_NODES"].split(",")
NODE_HEADERS = {"x-tine-cluster-secret": os.environ["TINE_BENCH_SECRET"], "x-tine-team": "default"}
N = int(os.environ["TINE_BENCH_N"])
CALLS = int(os.environ["TINE_BENCH_CALLS"])
SPREAD = int(os.environ["TINE_BENCH_SPREAD"])
made = []
out = {"create_gateway": [], "create_node": [], "run_gateway": [], "run_node": [], "spread": {}, "errors": []}


def timed(f):
    t = time.perf_counter()
    r = f()
    return r, (time.perf_counter() - t) * 1000


try:
    for i in range(N):
        # A pause before each create lets the nodes' warm pools refill, so
        # neither side meets a pool the other just emptied.
        time.sleep(1)
        s, ms = timed(lambda: Sandbox.create(api_url=GATEWAY, sandbox_url=GATEWAY))
        made.append(s)
        out["create_gateway"].append(ms)
        node = NODES[i % len(NODES)]
        time.sleep(1)
        s, ms = timed(lambda: Sandbox.create(api_url=node, sandbox_url=node, headers=NODE_HEADERS))
        made.append(s)
        out["create_node"].append(ms)
    # One sandbox made through the gateway, reached through it and straight
    # through its node (a sandbox made straight on a node is unknown to the
    # catalog until the node's next full list).
    via_gateway = made[0]
    node_id = httpx.get(f"{GATEWAY}/sandboxes/{via_gateway.sandbox_id}", headers={"X-API-KEY": KEY}).json()["nodeID"]
    node = NODES[int(node_id.split("-")[1]) - 1]
    on_node = Sandbox.connect(via_gateway.sandbox_id, api_url=node, sandbox_url=node, headers=NODE_HEADERS)
    for c in (on_node, via_gateway):
        c.commands.run("true")  # warm connections
    for _ in range(CALLS):
        out["run_gateway"].append(timed(lambda: via_gateway.commands.run("true"))[1])
        out["run_node"].append(timed(lambda: on_node.commands.run("true"))[1])
    for _ in range(SPREAD):
        s = Sandbox.create(api_url=GATEWAY, sandbox_url=GATEWAY)
        made.append(s)
        node = httpx.get(f"{GATEWAY}/sandboxes/{s.sandbox_id}", headers={"X-API-KEY": KEY}).json()["nodeID"]
        out["spread"][node] = out["spread"].get(node, 0) + 1
except Exception as e:  # reported as the rows' error
    out["errors"].append(f"{type(e).__name__}: {e}")
finally:
    for s in made:
        try:
            httpx.delete(f"{GATEWAY}/sandboxes/{s.sandbox_id}", headers={"X-API-KEY": KEY}, timeout=60)
        except Exception as e:
            out["errors"].append(f"kill {s.sandbox_id}: {e}")
print(json.dumps(out))
