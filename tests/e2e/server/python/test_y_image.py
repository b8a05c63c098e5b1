"""OCI images from a real registry (Debian's docker-registry on loopback):
`tine image pull`, a template built on an image, sandboxes that see exactly
the image's files, Env and WorkingDir, and clear errors for bad input."""

import gzip
import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import tarfile
import tempfile
import time
import urllib.error
import urllib.request

import pytest
from e2b import Sandbox

from conftest import http

TINE = os.environ["TINE_BIN"]
REGISTRY_BIN = shutil.which("docker-registry") or "/usr/bin/docker-registry"


def tine(*args, timeout=900):
    p = subprocess.run([TINE, *args], capture_output=True, text=True, timeout=timeout, env=os.environ)
    return p.returncode, p.stdout, p.stderr


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def req(method, url, body=None, headers=None):
    r = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    with urllib.request.urlopen(r, timeout=120) as resp:
        return resp.status, dict(resp.headers), resp.read()


class Registry:
    def __init__(self, auth=None):
        """auth: (user, password) for htpasswd (basic) auth, else none."""
        self.dir = tempfile.mkdtemp(prefix="tine-e2e-registry-")
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.headers = {}
        config = os.path.join(self.dir, "config.yml")
        with open(config, "w") as f:
            f.write(
                "version: 0.1\n"
                "log: {level: error}\n"
                f"storage: {{filesystem: {{rootdirectory: {self.dir}/data}}, delete: {{enabled: true}}}}\n"
                f"http: {{addr: '127.0.0.1:{self.port}'}}\n"
            )
            if auth:
                import base64
                import warnings
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    import crypt
                with open(os.path.join(self.dir, "htpasswd"), "w") as h:
                    h.write(f"{auth[0]}:{crypt.crypt(auth[1], crypt.mksalt(crypt.METHOD_BLOWFISH))}\n")
                f.write(f"auth: {{htpasswd: {{realm: tine, path: {self.dir}/htpasswd}}}}\n")
                token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
                self.headers = {"Authorization": f"Basic {token}"}
        self.proc = subprocess.Popen([REGISTRY_BIN, "serve", config], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 30
        while True:
            try:
                req("GET", f"http://{self.host}/v2/", headers=dict(self.headers))
                break
            except (urllib.error.URLError, ConnectionError):
                if time.time() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("docker-registry did not start")
                time.sleep(0.1)

    def push_blob(self, repo, data):
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        _, headers, _ = req("POST", f"http://{self.host}/v2/{repo}/blobs/uploads/", headers=dict(self.headers))
        location = headers["Location"]
        if location.startswith("/"):
            location = f"http://{self.host}{location}"
        sep = "&" if "?" in location else "?"
        req("PUT", f"{location}{sep}digest={digest}", data, {"Content-Type": "application/octet-stream", **self.headers})
        return digest

    def push_image(self, repo, tag, layers, config):
        """layers: list of (bytes, media type). Returns the manifest digest."""
        descs = []
        for data, media in layers:
            descs.append({"mediaType": media, "digest": self.push_blob(repo, data), "size": len(data)})
        config["rootfs"] = {"type": "layers", "diff_ids": []}
        cfg = json.dumps(config).encode()
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": self.push_blob(repo, cfg), "size": len(cfg)},
            "layers": descs,
        }
        body = json.dumps(manifest).encode()
        req("PUT", f"http://{self.host}/v2/{repo}/manifests/{tag}", body,
            {"Content-Type": "application/vnd.oci.image.manifest.v1+json", **self.headers})
        return "sha256:" + hashlib.sha256(body).hexdigest()

    def blob_file(self, digest):
        h = digest.split(":", 1)[1]
        return os.path.join(self.dir, "data/docker/registry/v2/blobs/sha256", h[:2], h, "data")

    def stop(self):
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def tar_layer(build):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        build(t)
    return gzip.compress(buf.getvalue(), compresslevel=1)


def add(t, name, data=b"", mode=0o644, kind=tarfile.REGTYPE, link=""):
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.linkname = kind, mode, link
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    info.uid = info.gid = 0
    t.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)


def layer_lower(t):
    add(t, "opt/img", kind=tarfile.DIRTYPE, mode=0o755)
    add(t, "opt/img/gone", b"deleted by a whiteout")
    add(t, "opt/img/keep", b"kept")
    add(t, "opt/img/opq", kind=tarfile.DIRTYPE, mode=0o755)
    add(t, "opt/img/opq/old", b"hidden by an opaque whiteout")


def layer_upper(t):
    add(t, "opt/img/.wh.gone")
    add(t, "opt/img/opq/.wh..wh..opq")
    add(t, "opt/img/opq/new", b"new")
    add(t, "opt/img/hard", kind=tarfile.LNKTYPE, link="opt/img/keep")
    add(t, "opt/img/soft", kind=tarfile.SYMTYPE, link="keep")
    add(t, "opt/img/suid", b"#!/bin/sh\necho hi\n", mode=0o4755)


GZ = "application/vnd.oci.image.layer.v1.tar+gzip"
TAR = "application/vnd.oci.image.layer.v1.tar"
CONFIG = {
    "architecture": "amd64", "os": "linux",
    "config": {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "TINE_IMG=from-image"],
               "WorkingDir": "/opt/img", "Cmd": ["/bin/bash"]},
}


@pytest.fixture(scope="module")
def registry():
    r = Registry()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def image(registry):
    base = os.path.realpath(os.path.join(os.environ["TINE_DATA_DIR"], "current", "rootfs-base.ext4"))
    with open(base[: -len(".ext4")] + ".tar", "rb") as f:
        debian = f.read()
    # The image has no `user` account: the top layer drops it from
    # /etc/passwd and /etc/group.
    accounts = {}
    with tarfile.open(fileobj=io.BytesIO(debian)) as t:
        for name in ("etc/passwd", "etc/group"):
            member = next(m for m in t.getmembers() if m.name.lstrip("./") == name)
            lines = t.extractfile(member).read().decode().splitlines(keepends=True)
            accounts[name] = "".join(l for l in lines if not l.startswith("user:")).encode()

    def no_user(t):
        layer_upper(t)
        for name, data in accounts.items():
            add(t, name, data)

    ref = f"{registry.host}/e2e/debian:v1"
    registry.push_image("e2e/debian", "v1",
                        [(debian, TAR), (tar_layer(layer_lower), GZ), (tar_layer(no_user), GZ)], dict(CONFIG))
    return ref


def test_pull_build_and_run_an_image(image, fresh):
    code, _, err = tine("image", "pull", image)
    assert code == 0, err
    code, out, _ = tine("image", "list")
    assert code == 0 and image in out
    code, _, err = tine("template", "build", "e2e-image", "--from-image", image,
                        "--vcpus", "1", "--memory-mib", "256", "--run", "echo built > /opt/img/built")
    assert code == 0, err
    assert f"FROM {image}" in err, err  # (booted, or a cached base layer)
    s = fresh(template="e2e-image", timeout=600)
    run = lambda c: s.commands.run(c, user="root").stdout.strip()
    assert run("ls /opt/img | sort | tr '\\n' ' '") == "built hard keep opq soft suid"
    assert run("ls /opt/img/opq") == "new"
    assert run("stat -c %i /opt/img/keep") == run("stat -c %i /opt/img/hard")
    assert run("readlink /opt/img/soft") == "keep"
    assert run("stat -c %a /opt/img/suid") == "4755"
    # The image's Env and WorkingDir apply to commands; the SDK's default
    # user exists.
    assert s.commands.run("echo $TINE_IMG").stdout.strip() == "from-image"
    assert s.commands.run("pwd").stdout.strip() == "/opt/img"
    # The image has no `user`; the template's writable layer added it.
    assert s.commands.run("whoami").stdout.strip() == "user"
    assert run("grep '^user:' /etc/passwd") == "user:x:1000:1000::/home/user:/bin/sh"
    # Pause / resume and fork work on an image's sandboxes as on base.
    run("echo state > /opt/img/state")
    assert s.pause() is True
    s = Sandbox.connect(s.sandbox_id, timeout=600)
    assert s.files.read("/opt/img/state") == "state\n"
    kids = s.fork(count=2, timeout=600)
    try:
        for k in kids:
            assert not isinstance(k, Exception), k
            assert k.commands.run("cat /opt/img/state /opt/img/keep").stdout == "state\nkept"
            assert k.commands.run("echo $TINE_IMG").stdout.strip() == "from-image"
    finally:
        for k in kids:
            if not isinstance(k, Exception):
                k.kill()
    # The template's image can't be removed while the template runs on it.
    code, _, err = tine("image", "rm", image)
    assert code != 0 and "used by" in err
    # Once the template and its sandbox are gone, so can the image be.
    s.kill()
    assert http("DELETE", "/templates/e2e-image")[0] == 204
    code, _, err = tine("image", "rm", image)
    assert code == 0, err
    code, out, _ = tine("image", "list")
    assert image not in out


def test_bad_images(registry):
    code, _, err = tine("image", "pull", f"{registry.host}/e2e/none:v1")
    assert code != 0 and "e2e/none" in err
    code, _, err = tine("image", "pull", f"127.0.0.1:{free_port()}/e2e/down:v1")
    assert code != 0 and "down" in err
    code, _, err = tine("image", "pull", "Not A Reference!")
    assert code != 0 and "invalid image reference" in err
    arm = dict(CONFIG, architecture="arm64")
    registry.push_image("e2e/arm", "v1", [(tar_layer(layer_lower), GZ)], arm)
    code, _, err = tine("image", "pull", f"{registry.host}/e2e/arm:v1")
    assert code != 0 and "linux/arm64" in err
    # A layer damaged in the registry's store is caught by its digest.
    data = tar_layer(lambda t: add(t, "opt/x", b"soon damaged " * 1000))
    registry.push_image("e2e/bad", "v1", [(data, GZ)], dict(CONFIG))
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    with open(registry.blob_file(digest), "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    code, _, err = tine("image", "pull", f"{registry.host}/e2e/bad:v1")
    assert code != 0 and digest in err, err
    # Mirrors are tried first: a registry that is down, mirrored by ours.
    mirrored = tar_layer(lambda t: add(t, "opt/mirrored", b"m"))
    registry.push_image("e2e/mirrored", "v1", [(mirrored, GZ)], dict(CONFIG))
    down = f"127.0.0.2:{free_port()}"
    with tempfile.NamedTemporaryFile("w", suffix=".toml") as cfg:
        cfg.write(f'[registries]\nmirrors = {{ "{down}" = ["{registry.host}"] }}\n')
        cfg.flush()
        code, _, err = tine("image", "pull", "--config", cfg.name, f"{down}/e2e/mirrored:v1")
    assert code == 0, err
    code, _, err = tine("image", "rm", f"{down}/e2e/mirrored:v1")
    assert code == 0, err
    # A small image that nothing uses is removed, with its blobs.
    small = tar_layer(lambda t: add(t, "opt/small", b"small"))
    registry.push_image("e2e/small", "v1", [(small, GZ)], dict(CONFIG))
    code, _, err = tine("image", "pull", f"{registry.host}/e2e/small:v1")
    assert code == 0, err
    blob = os.path.join(os.environ["TINE_DATA_DIR"], "images/blobs/sha256", hashlib.sha256(small).hexdigest())
    assert os.path.exists(blob)
    code, _, err = tine("image", "rm", f"{registry.host}/e2e/small:v1")
    assert code == 0, err
    assert not os.path.exists(blob)
    code, out, _ = tine("image", "list")
    assert "e2e/small" not in out
