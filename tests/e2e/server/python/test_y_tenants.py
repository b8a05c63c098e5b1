"""Tenant boundaries, each test an attack by one team (or a guest) on what
is another's: a private image another team pulled, a build context under a
public files hash, a guest's bytes on the API's origin."""

import json
import subprocess
import urllib.error
import urllib.request

import pytest
from e2b import Template
from e2b.exceptions import BuildException

from conftest import API, API_KEY, RUN, http, team_key
from test_y_image import GZ, Registry, add, tar_layer


@pytest.fixture(scope="module")
def red():
    return team_key("tenant-red")


@pytest.fixture(scope="module")
def blue():
    return team_key("tenant-blue")


def build(template, name, key, logs):
    return Template.build(template, name, cpu_count=1, memory_mb=256, api_key=key,
                          on_build_logs=logs.append)


def test_another_teams_private_image_is_not_served_without_credentials(red, blue):
    """Red pulls a private image with its credentials; blue, without any,
    must be refused by the registry, not handed red's local copy."""
    r = Registry(auth=("red", "secret"))
    try:
        layer = tar_layer(lambda t: add(t, "opt/red-secret", b"red's private bytes\n"))
        config = {"architecture": "amd64", "os": "linux", "config": {"Env": ["PATH=/usr/bin:/bin"]}}
        r.push_image("red/private", "v1", [(layer, GZ)], config)
        ref = f"{r.host}/red/private:v1"

        red_logs = []
        try:
            build(Template().from_image(ref, username="red", password="secret").run_cmd("true"),
                  "tenant-red-private", red, red_logs)
        except BuildException:
            pass  # (a one-file image need not boot: the pull is what counts)
        assert any("pulling" in e.message for e in red_logs), [e.message for e in red_logs]

        blue_logs = []
        with pytest.raises(BuildException) as e:
            build(Template().from_image(ref).run_cmd("cat /opt/red-secret"),
                  "tenant-blue-steal", blue, blue_logs)
        text = str(e.value) + "\n" + "\n".join(x.message for x in blue_logs)
        assert "local copy" not in text, text
        assert "red/private" in str(e.value), str(e.value)
        assert "unauthorized" in text.lower() or "not authorized" in text.lower(), text
        # Wrong credentials are no better than none.
        with pytest.raises(BuildException) as e:
            build(Template().from_image(ref, username="red", password="guess").run_cmd("true"),
                  "tenant-blue-steal", blue, [])
        assert "local copy" not in str(e.value), str(e.value)
    finally:
        r.stop()


def files_hash(template):
    steps = json.loads(Template.to_json(template))["steps"]
    return next(s["filesHash"] for s in steps if s["type"] == "COPY")


def put(url, body):
    req = urllib.request.Request(url, data=body, method="PUT")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_build_context_under_a_public_files_hash_is_never_another_teams(red, blue, tmp_path, fresh):
    """Blue computes the files hash of red's COPY (the SDK computes it from
    the files alone) and uploads its own files under it first; red's build
    must still copy red's files."""
    # (This run's own files: a team's map keeps what it was given.)
    (tmp_path / "app.txt").write_text(f"red's own app {RUN}\n")
    template = (Template(file_context_path=str(tmp_path)).from_template("base")
                .copy("app.txt", "/opt/app.txt"))
    h = files_hash(template)

    # Blue registers a template of its own to get an upload URL for h.
    status, _, body = http("POST", "/v3/templates", {"name": "tenant-blue-ctx", "cpuCount": 1, "memoryMB": 256},
                           key=blue)
    assert status in (200, 202), body
    status, _, body = http("GET", f"/templates/tenant-blue-ctx/files/{h}", key=blue)
    assert status == 201, body
    link = json.loads(body)
    assert link["present"] is False and "team=" in link["url"], link
    evil_dir = tmp_path / "evil"
    evil_dir.mkdir()
    (evil_dir / "app.txt").write_text("blue was here\n")
    evil = subprocess.run(["tar", "-C", str(evil_dir), "-cf", "-", "app.txt"], check=True,
                          capture_output=True).stdout
    assert put(link["url"], evil) == 200
    # The URL is blue's: the same signature for red's team is refused.
    forged = link["url"].replace("team=tenant-blue", "team=tenant-red")
    assert forged != link["url"] and put(forged, evil) == 401

    # Red's own view of h: not present (so its SDK uploads red's files).
    status, _, _ = http("POST", "/v3/templates", {"name": "tenant-red-ctx", "cpuCount": 1, "memoryMB": 256},
                        key=red)
    status, _, body = http("GET", f"/templates/tenant-red-ctx/files/{h}", key=red)
    assert status == 201 and json.loads(body)["present"] is False, body

    build(template, "tenant-red-ctx", red, [])
    s = fresh(template="tenant-red-ctx", api_key=red)
    assert s.commands.run("cat /opt/app.txt").stdout == f"red's own app {RUN}\n"


def test_a_guests_answer_to_a_signed_url_is_a_download_on_the_api_origin(fresh):
    """A signed /files URL against the API host: whatever the guest says
    its bytes are, a browser saves them and runs nothing on this origin."""
    s = fresh(secure=True)
    s.files.write("/tmp/page.html", "<script>alert(document.cookie)</script>")
    url = s.download_url("/tmp/page.html")
    assert url.startswith(API), url
    with urllib.request.urlopen(url, timeout=60) as resp:
        headers = {k.lower(): v for k, v in resp.headers.items()}
        assert resp.read() == b"<script>alert(document.cookie)</script>"
    assert headers["content-type"] == "application/octet-stream", headers
    assert headers["x-content-type-options"] == "nosniff", headers
    assert headers["content-security-policy"] == "sandbox", headers
    assert headers["content-disposition"].startswith("attachment"), headers


def test_a_secret_is_never_keyed_by_an_address_or_a_public_suffix():
    """A team's rule that would send its secret to whatever site the guest
    names at an address (a shared front end), or to any name under a
    public suffix (anyone can register one), is refused at create."""
    secret = {"transform": {"headers": {"Authorization": "Bearer ${e2b.secrets.tenant-key}"}}}
    for host in ["0.0.0.0/0", "203.0.113.20", "*.vercel.app", "*.com"]:
        status, _, body = http("POST", "/sandboxes",
                               {"templateID": "base", "network": {"rules": {host: [secret]}}})
        assert status == 400, (host, body)
        msg = json.loads(body)["message"]
        assert host in msg and ("must name its host" in msg or "public suffix" in msg), msg


def test_a_build_cannot_make_the_server_reach_its_own_network():
    """A key names, as its build's registry, a host on the server's private
    network (the stand-in's 10.99.0.10, which answers on 80 and 443) or
    the cloud metadata address: refused before any connection, and the
    log says why, not what answers there."""
    for ref in ["10.99.0.10/probe/x:v1", "10.99.0.10:80/probe/x:v1", "169.254.169.254/latest/x:v1"]:
        logs = []
        with pytest.raises(BuildException) as e:
            build(Template().from_image(ref).run_cmd("true"), "tenant-ssrf", API_KEY, logs)
        text = str(e.value) + "\n" + "\n".join(x.message for x in logs)
        assert "not on the internet" in text and "allow_private" in text, text
        assert "inet " not in text and "certificate" not in text.lower(), text
