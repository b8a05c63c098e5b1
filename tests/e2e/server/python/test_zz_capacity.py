"""Admission control by CPU: a host at its capacity refuses creates with
429 in E2B's error shape, and the sandboxes it holds go on answering.
(Runs before test_zz_restart and restarts the server as it does: with a
config whose max_sandboxes_per_core leaves room for two more sandboxes,
then as before.)"""

import json
import os
import re

import pytest
from e2b import Sandbox

from conftest import http, new_sandbox
from test_zz_restart import server

CONFIG = os.path.join(os.environ["TINE_E2E_STATE"], "config.toml")


def capacity():
    """The server's capacity gauges from /metrics: {kind: value}."""
    status, _, body = http("GET", "/metrics", key=None)
    assert status == 200
    found = re.findall(r'^tine_capacity_sandboxes\{kind="(\w+)"\} (\d+)', body.decode(), re.M)
    cores = re.search(r"^tine_host_cores (\d+)", body.decode(), re.M)
    assert found and cores, body.decode()[:2000]
    return {k: int(v) for k, v in found} | {"cores": int(cores.group(1))}


@pytest.fixture
def small_capacity(sbx):
    """The server restarted with room for two more sandboxes than it has."""
    before = capacity()
    cores = before["cores"]
    per_core = (before["in_use"] + 2.5) / cores
    original = open(CONFIG).read()
    with open(CONFIG, "w") as f:
        f.write(f"max_sandboxes_per_core = {per_core}\n" + original)
    server("stop", "TERM")
    server("start")
    try:
        yield capacity()
    finally:
        with open(CONFIG, "w") as f:
            f.write(original)
        server("stop", "TERM")
        server("start")


def test_a_full_host_refuses_creates_and_its_sandboxes_go_on(sbx, small_capacity):
    c = small_capacity
    room = c["total"] - c["in_use"]
    assert c["total"] == c["cpu"] and 1 <= room <= 3, c
    made = []
    try:
        for _ in range(room):
            made.append(new_sandbox(metadata={"group": "capacity"}))
        status, _, body = http("POST", "/sandboxes", {"templateID": "base"})
        err = json.loads(body)
        assert status == 429 and err["code"] == 429, (status, body)
        assert "at capacity" in err["message"] and "max_sandboxes_per_core" in err["message"], err
        with pytest.raises(Exception) as refused:
            new_sandbox(metadata={"group": "capacity"})
        assert "at capacity" in str(refused.value), repr(refused.value)
        # Everything live still answers while creates are refused.
        for s in [sbx, *made]:
            assert s.commands.run("echo up").stdout == "up\n"
        # A kill makes room again.
        made.pop().kill()
        made.append(new_sandbox(metadata={"group": "capacity"}))
        assert made[-1].commands.run("true").exit_code == 0
    finally:
        for s in made:
            Sandbox.kill(s.sandbox_id)
