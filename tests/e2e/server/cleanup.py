"""Kill every sandbox the test server knows, through its API.

The server's data dir belongs to the test run (see run.sh), so everything
it lists was made by a run of these suites."""

import json
import os
import sys
import urllib.error
import urllib.request

API = os.environ["E2B_API_URL"]
KEY = os.environ["E2B_API_KEY"]


def call(method, path):
    req = urllib.request.Request(API + path, method=method, headers={"X-API-KEY": KEY})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


ids = []
token = ""
while True:
    q = "?state=running,paused&limit=100" + (f"&nextToken={token}" if token else "")
    status, headers, body = call("GET", "/v2/sandboxes" + q)
    if status != 200:
        sys.exit(f"cleanup: listing sandboxes: {status} {body[:200]!r}")
    ids += [s["sandboxID"] for s in json.loads(body)]
    token = headers.get("x-next-token") or ""
    if not token:
        break

failed = 0
for sid in ids:
    status, _, body = call("DELETE", f"/sandboxes/{sid}")
    if status not in (204, 404):
        print(f"cleanup: killing {sid}: {status} {body[:200]!r}", file=sys.stderr)
        failed += 1
if ids:
    print(f"cleanup: killed {len(ids) - failed} sandbox(es)", file=sys.stderr)
sys.exit(1 if failed else 0)
