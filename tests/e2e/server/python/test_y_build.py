"""Template builds through E2B's Template API with the real Python SDK:
`Template().from_image(<loopback registry image>)...` built with
`Template.build`, every step cached, Dockerfiles (SDK and CLI), tags, and
bad input that leaves nothing behind."""

import hashlib
import io
import json
import os
import tarfile
import time

import pytest
from e2b import Sandbox, Template, wait_for_file
from e2b.exceptions import BuildException

from conftest import API, RUN, http, tagged
from test_y_image import TAR, Registry, tine

DATA = os.environ["TINE_DATA_DIR"]
SHAPE = dict(cpu_count=1, memory_mb=256)


@pytest.fixture(scope="module")
def image():
    """The e2e base rootfs as a one-layer image in a loopback registry."""
    r = Registry()
    base = os.path.realpath(os.path.join(DATA, "current", "rootfs-base.ext4"))
    with open(base[: -len(".ext4")] + ".tar", "rb") as f:
        debian = f.read()
    config = {"architecture": "amd64", "os": "linux",
              "config": {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                                 "TINE_IMG=built"]}}
    r.push_image("e2e/build-base", "v1", [(debian, TAR)], config)
    yield f"{r.host}/e2e/build-base:v1"
    r.stop()


@pytest.fixture
def ctx(tmp_path):
    (tmp_path / "hello.txt").write_text("hello from the context\n")
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "run.sh").write_text("#!/bin/sh\necho running\n")
    (tmp_path / "app" / "data.txt").write_text("data\n")
    return tmp_path


def build_vms():
    d = os.path.join(DATA, "vms")
    return sorted(v for v in os.listdir(d) if v.startswith("build-")) if os.path.isdir(d) else []


def messages(logs):
    return [e.message for e in logs]


def sdk_template(ctx, image, last="echo v1 > /tmp/last"):
    return (
        Template(file_context_path=str(ctx))
        .from_image(image)
        .copy("hello.txt", "/opt/hello.txt", user="root", mode=0o600)
        .copy("app", "/srv/app/")
        .run_cmd("id -un > /tmp/who-run && echo ran > /tmp/run.txt")
        .set_envs({"GREETING": "hi there"})
        .set_workdir("/srv/app")
        .run_cmd("echo $GREETING > greeting.txt && pwd > where.txt")
        .set_user("root")
        .run_cmd("id -un > /root/who-root")
        .set_user("user")
        .run_cmd(last)
        # Written aside and renamed: a reader never sees the file emptied
        # by the redirection before `date` has written to it.
        .set_start_cmd("sh -c 'while true; do date +%s > /tmp/alive.t && mv /tmp/alive.t /tmp/alive; sleep 1; done'",
                       wait_for_file("/tmp/alive"))
    )


def test_build_from_an_image_and_create_from_it(ctx, image, fresh):
    logs = []
    info = Template.build(sdk_template(ctx, image), "e2e-build", on_build_logs=logs.append, **SHAPE)
    text = "\n".join(messages(logs))
    assert info.template_id == "e2e-build" and "default" in info.tags, info
    assert "template e2e-build ready" in text, text
    assert Template.exists("e2e-build")
    assert build_vms() == []

    s = fresh(template="e2e-build")
    run = lambda cmd, user="user": s.commands.run(cmd, user=user).stdout.strip()
    # COPY: contents, owners and modes.
    assert run("cat /opt/hello.txt", "root") == "hello from the context"
    assert run("stat -c '%U %a' /opt/hello.txt", "root") == "root 600"
    assert run("stat -c '%U' /srv/app /srv/app/run.sh /srv/app/data.txt") == "user\nuser\nuser"
    assert run("cat /srv/app/data.txt") == "data"
    # RUN as the step's user, with the env and workdir so far.
    assert run("cat /tmp/who-run") == "user"
    assert run("cat /srv/app/greeting.txt") == "hi there"
    assert run("cat /srv/app/where.txt") == "/srv/app"
    assert run("cat /root/who-root", "root") == "root"
    assert run("cat /tmp/last") == "v1"
    # The template's env and workdir reach the sandbox; so does the image's.
    assert run("echo $GREETING") == "hi there"
    assert run("echo $TINE_IMG") == "built"
    assert run("pwd") == "/srv/app"
    # The start command runs in the sandbox (restored, not rebooted).
    first = int(run("cat /tmp/alive"))
    time.sleep(2.5)
    assert int(run("cat /tmp/alive")) > first
    assert "while true" in run("ps -eo args")


def test_a_second_build_reuses_every_layer_and_a_change_rebuilds_from_there(ctx, image):
    logs = []
    Template.build(sdk_template(ctx, image), "e2e-build", on_build_logs=logs.append, **SHAPE)
    text = messages(logs)
    cached = [m for m in text if m.startswith("CACHED")]
    assert any("FROM" in m for m in cached), text
    # 2 COPY and 4 RUN steps, each cached.
    assert sum(1 for m in cached if " COPY " in m or " RUN " in m) == 6, text
    assert any("every step cached" in m for m in text), text

    logs = []
    # (A value of this run's: the data dir, and its layers, outlive runs.)
    Template.build(sdk_template(ctx, image, last=f"echo {RUN} > /tmp/last"), "e2e-build",
                   on_build_logs=logs.append, **SHAPE)
    text = messages(logs)
    cached = [m for m in text if m.startswith("CACHED") and (" COPY " in m or " RUN " in m)]
    assert len(cached) == 5, text
    assert any(m.startswith(f"[10/10] RUN echo {RUN}") for m in text), text
    s = Sandbox.create("e2e-build", metadata=tagged())
    try:
        assert s.commands.run("cat /tmp/last").stdout.strip() == RUN
    finally:
        s.kill()
    # Another template with the same steps shares every layer.
    logs = []
    Template.build(sdk_template(ctx, image), "e2e-build-twin", on_build_logs=logs.append, **SHAPE)
    cached = [m for m in messages(logs) if m.startswith("CACHED") and (" COPY " in m or " RUN " in m)]
    assert len(cached) == 6, messages(logs)
    s = Sandbox.create("e2e-build-twin", metadata=tagged())
    try:
        assert s.commands.run("cat /tmp/last /srv/app/greeting.txt").stdout == "v1\nhi there\n"
    finally:
        s.kill()


def test_skip_cache_rebuilds_and_background_build_reports_status(ctx, image):
    info = Template.build_in_background(sdk_template(ctx, image), "e2e-build", skip_cache=True, **SHAPE)
    deadline = time.time() + 600
    offset, seen = 0, []
    while True:
        st = Template.get_build_status(info, logs_offset=offset)
        offset += len(st.log_entries)
        seen += [e.message for e in st.log_entries]
        if st.status.value not in ("building", "waiting"):
            break
        assert time.time() < deadline
        time.sleep(0.5)
    assert st.status.value == "ready", seen
    assert not any(m.startswith("CACHED") for m in seen), seen


def test_tags(ctx, image):
    # Deleting a template (from an earlier run) deletes its tags.
    assert api("DELETE", "/templates/e2e-tags")[0] in (204, 404)
    assert api("GET", "/templates/e2e-tags/tags")[0] == 404
    Template.build(Template().from_template("base").run_cmd("echo tagged > /tmp/tag"),
                   "e2e-tags:v1", **SHAPE)
    tags = {t.tag for t in Template.get_tags("e2e-tags")}
    assert tags == {"v1"}, tags
    s = Sandbox.create("e2e-tags:v1", metadata=tagged())
    try:
        assert s.commands.run("cat /tmp/tag").stdout.strip() == "tagged"
    finally:
        s.kill()
    info = Template.assign_tags("e2e-tags:v1", ["prod"])
    assert info.tags == ["prod"]
    assert {t.tag for t in Template.get_tags("e2e-tags")} == {"v1", "prod"}
    Template.remove_tags("e2e-tags", "v1")
    assert {t.tag for t in Template.get_tags("e2e-tags")} == {"prod"}
    with pytest.raises(Exception):
        Sandbox.create("e2e-tags:v1", metadata=tagged())


DOCKERFILE = """\
FROM {image}
ENV MODE=docker
WORKDIR /work
COPY hello.txt ./
COPY --chown=user --chmod=750 app /work/app
RUN echo "$MODE" > mode.txt && id -un > whoami
USER user
RUN id -un > /tmp/docker-user
"""


def sdk_parses_copy_chmod():
    """Whether this SDK's Dockerfile parser keeps `COPY --chmod` (2.45's
    drops it: the file then has the context's mode)."""
    import inspect

    try:
        import e2b.template.dockerfile_parser as parser
    except ImportError:
        return False
    return '"chmod"' in inspect.getsource(parser)


def check_dockerfile_sandbox(name, chmod=True):
    s = Sandbox.create(name, metadata=tagged())
    try:
        run = lambda cmd: s.commands.run(cmd, user="root").stdout.strip()
        assert run("cat /work/hello.txt") == "hello from the context"
        assert run("cat /work/mode.txt /work/whoami") == "docker\nroot"
        assert run("stat -c '%U %a' /work/app/run.sh") == ("user 750" if chmod else "user 644")
        assert run("cat /tmp/docker-user") == "user"
        assert s.commands.run("echo $MODE").stdout.strip() == "docker"
    finally:
        s.kill()


def test_from_dockerfile_through_the_sdk(ctx, image):
    t = Template(file_context_path=str(ctx)).from_dockerfile(DOCKERFILE.format(image=image))
    Template.build(t, "e2e-dockerfile", **SHAPE)
    check_dockerfile_sandbox("e2e-dockerfile", chmod=sdk_parses_copy_chmod())


def test_the_same_dockerfile_through_the_cli(ctx, image):
    (ctx / "Dockerfile").write_text(DOCKERFILE.format(image=image))
    code, _, err = tine("template", "build", "-f", str(ctx / "Dockerfile"), str(ctx), "e2e-dockerfile-cli",
                        "--vcpus", "1", "--memory-mib", "256")
    assert code == 0, err
    assert "[6/10] RUN" in err or "RUN echo" in err, err
    check_dockerfile_sandbox("e2e-dockerfile-cli")
    # Built again: every step is cached.
    code, _, err = tine("template", "build", "-f", str(ctx / "Dockerfile"), str(ctx), "e2e-dockerfile-cli",
                        "--vcpus", "1", "--memory-mib", "256")
    assert code == 0 and "every step cached" in err, err
    # A syntax error names its line; nothing is built.
    (ctx / "Bad").write_text("FROM x\nCOPY --from=a b c\n")
    code, _, err = tine("template", "build", "-f", str(ctx / "Bad"), str(ctx), "e2e-bad-cli")
    assert code != 0 and "line 2" in err and "--from" in err, err
    assert not Template.exists("e2e-bad-cli")


def expect_build_error(template, name, *want, logs=None):
    with pytest.raises(BuildException) as e:
        Template.build(template, name, on_build_logs=(logs.append if logs is not None else None), **SHAPE)
    for w in want:
        assert w in str(e.value), str(e.value)
    assert not Template.exists(name)
    assert build_vms() == []
    return str(e.value)


def test_a_failing_run_names_its_step_and_output():
    t = (Template().from_template("base").run_cmd(f"echo fine {RUN}")
         .run_cmd("echo broken-output >&2; exit 7"))
    logs = []
    expect_build_error(t, "e2e-fail", "RUN echo broken-output", "exited with 7", "broken-output", logs=logs)
    # Each step's output reached the build log as lines.
    text = messages(logs)
    assert f"fine {RUN}" in text and "broken-output" in text, text


def test_a_ready_command_that_never_passes():
    t = Template().from_template("base").set_start_cmd("sleep 1000", "false")
    expect_build_error(t, "e2e-never-ready", "ready command `false` did not pass within 20 s")


def test_an_unknown_base_image():
    t = Template().from_image("127.0.0.1:1/nothing/here:v1").run_cmd("true")
    expect_build_error(t, "e2e-no-image", "127.0.0.1:1/nothing/here:v1")


def test_unknown_template_and_unsupported_registry_are_refused():
    t = Template().from_template("no-such-template")
    with pytest.raises(BuildException) as e:
        Template.build(t, "e2e-no-tpl", **SHAPE)
    assert "no-such-template" in str(e.value) and "not found" in str(e.value)
    assert not Template.exists("e2e-no-tpl")


def api(method, path, body=None):
    code, _, raw = http(method, path, body)
    return code, (json.loads(raw) if raw else None)


def put(url, data):
    assert url.startswith(API)
    code, _, raw = http("PUT", url[len(API):], data, key=None, timeout=120)
    return code, (json.loads(raw) if raw else None)


def test_uploads_are_signed_checked_and_bounded(tmp_path):
    code, body = api("POST", "/v3/templates", {"name": "e2e-upload", "cpuCount": 1, "memoryMB": 256})
    assert code == 202, body
    build_id = body["buildID"]
    # A hash of this run's (the server's uploads outlive runs).
    h = hashlib.sha256(RUN.encode()).hexdigest()
    code, link = api("GET", f"/templates/e2e-upload/files/{h}")
    assert code == 201 and link["present"] is False, link
    url = link["url"]
    assert url.startswith(API + "/build-files/" + h + "?"), url
    # A wrong signature, and the right one for another hash.
    assert put(url.replace("signature=", "signature=00"), b"x")[0] == 401
    assert put(url.replace(h, "cd" * 32), b"x")[0] == 401
    assert put(url.split("?")[0], b"x")[0] == 401
    # Not a tar archive.
    code, err = put(url, b"definitely not a tar archive" * 40)
    assert code == 400 and "not a tar" in err["message"], err
    # Over the server's limit (8 MiB in the e2e config).
    code, err = put(url, os.urandom(9 << 20))
    assert code == 413, err
    # A real archive without the file a COPY names (and big enough to
    # pass any default body limit, under the server's own): the build says so.
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=1) as t:
        info = tarfile.TarInfo("other.txt")
        info.size = 2
        t.addfile(info, io.BytesIO(b"hi"))
        big = os.urandom(5 << 20)
        info = tarfile.TarInfo("big.bin")
        info.size = len(big)
        t.addfile(info, io.BytesIO(big))
    assert len(buf.getvalue()) > 5 << 20
    assert put(url, buf.getvalue())[0] == 200
    code, link = api("GET", f"/templates/e2e-upload/files/{h}")
    assert code == 201 and link["present"] is True, link
    steps = [{"type": "COPY", "args": ["missing.txt", "/tmp/", "", ""], "filesHash": h, "force": False}]
    code, body = api("POST", f"/v2/templates/e2e-upload/builds/{build_id}",
                     {"fromTemplate": "base", "force": False, "steps": steps})
    assert code == 202, body
    deadline = time.time() + 300
    while True:
        code, st = api("GET", f"/templates/e2e-upload/builds/{build_id}/status")
        assert code == 200, st
        if st["status"] not in ("building", "waiting"):
            break
        assert time.time() < deadline
        time.sleep(0.5)
    assert st["status"] == "error", st
    assert st["reason"]["step"] == "1" and "missing.txt" in st["reason"]["message"], st
    assert not Template.exists("e2e-upload")
    # A second start of the same build is refused; so are bad steps,
    # unknown builds and files that were never uploaded.
    code, body = api("POST", f"/v2/templates/e2e-upload/builds/{build_id}", {"steps": []})
    assert code == 409, body
    code, body = api("POST", "/v3/templates", {"name": "e2e-upload"})
    b2 = body["buildID"]
    code, body = api("POST", f"/v2/templates/e2e-upload/builds/{b2}",
                     {"fromTemplate": "base", "steps": [{"type": "FROB", "args": []}]})
    assert code == 400 and "FROB" in body["message"], body
    code, body = api("POST", f"/v2/templates/e2e-upload/builds/{b2}",
                     {"fromTemplate": "base", "steps": [
                         {"type": "COPY", "args": ["a", "/a", "", ""], "filesHash": "ef" * 32}]})
    assert code == 400 and "not uploaded" in body["message"], body
    code, body = api("GET", "/templates/e2e-upload/builds/00000000-0000-0000-0000-000000000000/status")
    assert code == 404 and body["code"] == 404, body
    code, body = api("POST", "/v3/templates", {"name": "Bad Name!"})
    assert code == 400, body
    code, body = api("GET", "/templates/aliases/e2e-upload")
    assert code == 404 and body["code"] == 404, body
    assert build_vms() == []


def wait_build(info, until=("ready", "error"), timeout=300):
    deadline, offset, seen = time.time() + timeout, 0, []
    while True:
        st = Template.get_build_status(info, logs_offset=offset)
        offset += len(st.log_entries)
        seen += [e.message for e in st.log_entries]
        if st.status.value in until:
            return st, seen
        assert time.time() < deadline, (st.status, seen)
        time.sleep(0.3)


def test_builds_over_the_limit_wait_their_turn():
    """The e2e server runs one build at a time (max_concurrent_builds = 1)."""
    slow = Template().from_template("base").run_cmd(f"echo slow {RUN} && sleep 8")
    quick = Template().from_template("base").run_cmd(f"echo quick {RUN}")
    a = Template.build_in_background(slow, "e2e-queue-a", **SHAPE)
    st, seen = wait_build(a, until=("building", "error"))
    assert st.status.value == "building", seen
    b = Template.build_in_background(quick, "e2e-queue-b", **SHAPE)
    st = Template.get_build_status(b)
    assert st.status.value == "waiting", st
    st, seen_b = wait_build(b)
    assert st.status.value == "ready", seen_b
    assert "waiting for a free build slot" in seen_b
    st, _ = wait_build(a)
    assert st.status.value == "ready"
