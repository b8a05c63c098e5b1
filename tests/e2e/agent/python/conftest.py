"""Fixtures for the agent end-to-end suite.

The agent runs on 127.0.0.1:49983 (started by ../run.sh). With
E2B_DEBUG=true the SDK skips the control plane and talks to
localhost:49983 directly.
"""

import json
import os
import urllib.error
import urllib.request
import uuid

import pytest

os.environ.setdefault("E2B_DEBUG", "true")
os.environ.setdefault("E2B_API_KEY", "tine-e2e")

from e2b import AsyncSandbox, ConnectionConfig, Sandbox  # noqa: E402

try:
    from e2b.envd.versions import ENVD_DEBUG_FALLBACK  # noqa: E402
except ImportError:  # SDKs before 2.7 have no sandbox handle to build by hand
    ENVD_DEBUG_FALLBACK = None

from importlib.metadata import version as _version  # noqa: E402

SDK = tuple(int(x) for x in _version("e2b").split(".")[:2])


def needs_sdk(major_minor, why):
    """Skip a test on SDK versions older than `major_minor`."""
    return pytest.mark.skipif(SDK < major_minor, reason=f"e2b {SDK}: {why}")

AGENT = "http://127.0.0.1:49983"


@pytest.fixture
def sbx():
    return Sandbox.create()


@pytest.fixture
async def asbx():
    return await AsyncSandbox.create()


@pytest.fixture
def tmpdir_in_sandbox(sbx):
    """A fresh directory the default user owns."""
    path = f"/tmp/tine-e2e-{uuid.uuid4().hex[:10]}"
    assert sbx.files.make_dir(path)
    yield path
    sbx.commands.run(f"rm -rf {path}", user="root")


def sandbox_with_token(token):
    """A Sandbox handle that sends X-Access-Token (as after a real create)."""
    if ENVD_DEBUG_FALLBACK is None:
        pytest.skip("this SDK cannot build a sandbox handle with a token")
    headers = {
        "E2b-Sandbox-Id": "debug_sandbox_id",
        "E2b-Sandbox-Port": "49983",
        "X-Access-Token": token,
    }
    return Sandbox(
        sandbox_id="debug_sandbox_id",
        sandbox_domain=None,
        envd_version=ENVD_DEBUG_FALLBACK,
        envd_access_token=token,
        traffic_access_token=None,
        connection_config=ConnectionConfig(extra_sandbox_headers=headers),
    )


def http(method, path, body=None, headers=None):
    """A raw request to the agent: (status, headers, body bytes)."""
    req = urllib.request.Request(AGENT + path, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def connect_frames(body):
    """Splits a Connect streaming body into (flags, json) frames."""
    frames = []
    i = 0
    while i + 5 <= len(body):
        flags = body[i]
        n = int.from_bytes(body[i + 1 : i + 5], "big")
        frames.append((flags, json.loads(body[i + 5 : i + 5 + n] or b"{}")))
        i += 5 + n
    assert i == len(body), "trailing bytes after the last frame"
    return frames


def envelope(obj, flags=0):
    payload = json.dumps(obj).encode()
    return bytes([flags]) + len(payload).to_bytes(4, "big") + payload
