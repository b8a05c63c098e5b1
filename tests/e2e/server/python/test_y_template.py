"""Templates built with `tine template build`: create from one restores its
state, including a process its start command left running."""

import os
import subprocess
import urllib.request

import pytest
from e2b import Sandbox

from conftest import API, API_KEY, assert_error, http, new_sandbox, qemu_pid, ram_usage

TINE = os.environ["TINE_BIN"]


def tine(*args, timeout=600):
    p = subprocess.run([TINE, *args], capture_output=True, text=True, timeout=timeout, env=os.environ)
    return p.returncode, p.stdout, p.stderr


def test_build_create_list_delete(fresh):
    code, _, err = tine(
        "template", "build", "e2e-web",
        "--vcpus", "1", "--memory-mib", "256",
        "--run", "mkdir -p /srv && echo built-by-e2e > /srv/index.html",
        "--start", "cd /srv && python3 -m http.server 8000",
        "--ready", "curl -sf http://127.0.0.1:8000/index.html",
    )
    assert code == 0, err
    # The one build engine's log: each step, the start and ready commands.
    assert "[1/2] USER root" in err and "[2/2] RUN mkdir -p /srv" in err, err
    assert "waiting for the ready command" in err and "built in" in err, "the build shows its steps"

    status, _, body = http("GET", "/templates")
    assert status == 200
    assert "e2e-web" in [t["templateID"] for t in __import__("json").loads(body)]

    s = fresh(template="e2e-web", timeout=600)
    assert s.files.read("/srv/index.html") == "built-by-e2e\n"
    # The start command is running in the new sandbox: reach it by Host.
    req = urllib.request.Request(API + "/index.html", headers={"Host": s.get_host(8000)})
    assert urllib.request.urlopen(req, timeout=30).read() == b"built-by-e2e\n"

    code, out, _ = tine("template", "list")
    assert code == 0 and "e2e-web" in out
    assert http("DELETE", "/templates/e2e-web")[0] == 204
    assert_error(http("DELETE", "/templates/e2e-web"), 404)
    with pytest.raises(Exception):
        new_sandbox(template="e2e-web")
    # The sandbox made from it keeps working after the delete.
    assert s.commands.run("cat /srv/index.html").stdout == "built-by-e2e\n"


def test_bad_templates():
    code, _, err = tine("template", "build", "Bad Name!")
    assert code != 0 and "name" in err
    code, _, err = tine("template", "build", "e2e-fails", "--vcpus", "1", "--memory-mib", "256", "--run", "exit 7")
    assert code != 0 and "exited with 7" in err
    code, out, _ = tine("template", "list")
    assert "e2e-fails" not in out
    assert_error(http("DELETE", "/templates/base"), 400)
    assert_error(http("POST", "/v2/sandboxes", {"templateID": "no-such-template"}), 404)


def test_ten_creates_share_the_template_ram(fresh):
    boxes = [fresh(timeout=600) for _ in range(10)]
    for s in boxes:
        assert s.commands.run("cat /etc/os-release").stdout.startswith("PRETTY_NAME=\"Debian")
    for s in boxes:
        rss, pss, shared = ram_usage(qemu_pid(s.sandbox_id), "/snapshots/tpl-")
        assert rss > 0, f"{s.sandbox_id} maps the template's RAM file"
        assert shared > 0 and pss < rss, f"{s.sandbox_id} shares its pages: rss {rss} pss {pss} shared {shared} KiB"
