"""Fixtures for the server end-to-end suite.

`tine serve` runs on 127.0.0.1:$TINE_E2E_PORT with real VMs (started by
../run.sh), and the SDKs reach it through E2B_API_URL / E2B_SANDBOX_URL.
Every sandbox a test makes carries the metadata {"tine-e2e": RUN} so the
list tests can look at this run's sandboxes only.
"""

import json
import os
import subprocess
import urllib.error
import urllib.request
import uuid

import pytest

for var in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_VOLUME_API_URL", "E2B_API_KEY", "TINE_E2E_PORT"):
    if not os.environ.get(var):
        raise RuntimeError(f"{var} is not set: run tests/e2e/server/run.sh")

from e2b import Sandbox  # noqa: E402

API = os.environ["E2B_API_URL"].rstrip("/")
API_KEY = os.environ["E2B_API_KEY"]
PORT = int(os.environ["TINE_E2E_PORT"])
HERE = os.path.dirname(os.path.abspath(__file__))
RUN = uuid.uuid4().hex[:12]


def tagged(metadata=None):
    return {"tine-e2e": RUN, **(metadata or {})}


def new_sandbox(**kw):
    """Sandbox.create with this run's tag in its metadata."""
    kw["metadata"] = tagged(kw.get("metadata"))
    return Sandbox.create(**kw)


@pytest.fixture(scope="session")
def sbx():
    """One sandbox shared by the tests that only use it."""
    # (It must outlive the whole suite, which takes over 10 minutes.)
    s = new_sandbox(envs={"TINE_E2E_ENV": "from-create"}, timeout=3600)
    yield s
    s.kill()


@pytest.fixture
def fresh():
    """Sandboxes made by one test, killed after it: call fresh(**create_kw)."""
    made = []

    def make(**kw):
        s = new_sandbox(**kw)
        made.append(s)
        return s

    yield make
    for s in made:
        try:
            s.kill()
        except Exception:
            pass


def http(method, path, body=None, headers=None, key=API_KEY, timeout=60):
    """A raw request to the server: (status, headers, body bytes).

    `key` is sent as X-API-KEY unless it is None."""
    h = dict(headers or {})
    if key is not None:
        h.setdefault("X-API-KEY", key)
    if isinstance(body, (dict, list)):
        body = json.dumps(body).encode()
        h.setdefault("Content-Type", "application/json")
    req = urllib.request.Request(API + path, data=body, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def assert_error(resp, status):
    """An E2B error response: the status, and {"code": status, "message": str}."""
    got, headers, body = resp
    assert got == status, f"expected {status}, got {got}: {body[:300]!r}"
    try:
        doc = json.loads(body)
    except ValueError:
        raise AssertionError(f"{status} body is not JSON: {body[:300]!r}")
    assert isinstance(doc, dict), doc
    assert doc.get("code") == status and type(doc.get("code")) is int, doc
    assert isinstance(doc.get("message"), str) and doc["message"], doc
    return doc


def qemu_pid(sandbox_id):
    """The QEMU process of a sandbox: the one whose command line names its
    VM directory."""
    needle = f"/vms/{sandbox_id}/".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if needle in f.read():
                    return int(pid)
        except OSError:
            continue
    raise AssertionError(f"no QEMU for {sandbox_id}")


def ram_usage(pid, under):
    """(Rss, Pss, Shared) in KiB of the QEMU's mapping of a snapshot RAM
    file whose path contains `under` (e.g. "/snapshots/tpl-")."""
    rss = pss = shared = 0
    inside = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split()[0]
            if "-" in first and not first.endswith(":"):
                inside = under in line and line.rstrip().endswith("/ram")
                continue
            if inside:
                kib = int(line.split()[1]) if line.split()[1].isdigit() else 0
                if first == "Rss:":
                    rss += kib
                elif first == "Pss:":
                    pss += kib
                elif first in ("Shared_Clean:", "Shared_Dirty:"):
                    shared += kib
    return rss, pss, shared


def team_key(team, name=None):
    """A new API key of `team` (made with the server's own CLI)."""
    out = subprocess.run(
        [os.environ["TINE_BIN"], "keys", "create", "--name", name or f"e2e-{team}", "--team", team],
        check=True, capture_output=True, text=True, env={**os.environ},
    )
    return out.stdout.strip()


@pytest.fixture(scope="session")
def other_key():
    """An API key of another team (`vol-other`)."""
    return team_key("vol-other", "vol-other")
