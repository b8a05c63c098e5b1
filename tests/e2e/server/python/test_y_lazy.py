"""Lazily loaded images: one host converts an image and pushes it (`tine
image push`); a second host, with its own data dir, server and a chunk
cache far smaller than the image, starts sandboxes of it fetching only the
chunks they read, reads every file correctly, and keeps the cache within
its bound; a chunk damaged in the registry is an error naming it."""

import contextlib
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import tarfile
import time
import urllib.request

import pytest
from e2b import Sandbox

from test_y_image import CONFIG, GZ, TAR, Registry, add, free_port, layer_lower, layer_upper, tar_layer, tine

CACHE_MAX = 16 << 20
# What the guest reads in full; the expected sums come from the image's tar.
READ_DIRS = ["usr/bin", "usr/lib/x86_64-linux-gnu"]


@pytest.fixture(scope="module")
def registry():
    r = Registry()
    yield r
    r.stop()


def base_tar():
    base = os.path.realpath(os.path.join(os.environ["TINE_DATA_DIR"], "current", "rootfs-base.ext4"))
    with open(base[: -len(".ext4")] + ".tar", "rb") as f:
        return f.read()


def expected_sums(debian):
    """sha256 of every regular file (and hardlink) under READ_DIRS."""
    sums, data = {}, {}
    with tarfile.open(fileobj=io.BytesIO(debian)) as t:
        for m in t.getmembers():
            name = m.name.lstrip("./")
            if m.isreg():
                data[name] = hashlib.sha256(t.extractfile(m).read()).hexdigest()
            elif m.islnk():
                data[name] = data.get(m.linkname.lstrip("./"))
            else:
                continue
            if any(name.startswith(d + "/") for d in READ_DIRS):
                sums[name] = data[name]
    return sums


@pytest.fixture(scope="module")
def images(registry):
    """Two images (base + different top layers), converted and pushed by
    the suite's own host."""
    debian = base_tar()
    refs = []
    for tag, extra in (("v1", b"one"), ("v2", b"two")):
        def top(t, extra=extra):
            layer_upper(t)
            add(t, "opt/img/which", extra)
        ref = f"{registry.host}/e2e/lazy:{tag}"
        registry.push_image("e2e/lazy", tag, [(debian, TAR), (tar_layer(layer_lower), GZ), (tar_layer(top), GZ)],
                            dict(CONFIG))
        code, _, err = tine("image", "pull", "--no-lazy", ref)
        assert code == 0, err
        code, _, err = tine("image", "push", ref)
        assert code == 0, err
        assert "pushed" in err
        refs.append(ref)
    yield refs, expected_sums(debian)
    for ref in refs:
        tine("image", "rm", ref)


class Host:
    """A second tine host on this machine: its own data dir (sharing only
    the guest kernel and initramfs), server, image daemon and cache."""

    def __init__(self, name, cache_max):
        base = os.path.dirname(os.environ["TINE_DATA_DIR"])
        self.dir = os.path.join(base, name)
        self.stop_vms()
        shutil.rmtree(self.dir, ignore_errors=True)
        os.makedirs(self.dir)
        os.symlink(os.path.join(base, "current"), os.path.join(self.dir, "current"))
        self.env = dict(os.environ, TINE_DATA_DIR=self.dir, TINE_SHM_DIR=f"/dev/shm/tine-{name}")
        self.config = os.path.join(self.dir, "config.toml")
        with open(self.config, "w") as f:
            f.write(f"default_cpu_count = 1\ndefault_memory_mb = 256\npool_size = 0\n"
                    f"image_cache_max_bytes = {cache_max}\n")
        self.port = free_port()
        self.server = None

    def tine(self, *args, timeout=900):
        p = subprocess.run([os.environ["TINE_BIN"], *args], capture_output=True, text=True,
                           timeout=timeout, env=self.env)
        return p.returncode, p.stdout, p.stderr

    def serve(self):
        code, key, err = self.tine("keys", "create", "--name", "lazy")
        assert code == 0, err
        self.key = key.strip()
        self.log = open(os.path.join(self.dir, "server.log"), "w")
        self.server = subprocess.Popen(
            [os.environ["TINE_BIN"], "serve", "--listen", f"127.0.0.1:{self.port}", "-c", self.config],
            env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2)
                return
            except OSError:
                assert time.time() < deadline and self.server.poll() is None, "the second server did not start"
                time.sleep(0.2)

    @contextlib.contextmanager
    def sdk(self):
        """E2B_* pointed at this host while inside."""
        keys = ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY")
        saved = {k: os.environ.get(k) for k in keys}
        url = f"http://127.0.0.1:{self.port}"
        os.environ.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY=self.key)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def stats(self):
        # The daemon writes them every second.
        time.sleep(1.5)
        with open(os.path.join(self.dir, "run", "image-cache.json")) as f:
            return json.load(f)

    def meta(self, ref):
        code, out, err = self.tine("image", "list")
        assert code == 0, err
        digest = next(line.split("\t")[1] for line in out.splitlines() if line.startswith(ref + "\t"))
        with open(os.path.join(self.dir, "images", digest.split(":")[1], "meta.json")) as f:
            return json.load(f)

    def metrics(self):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            return r.read().decode()

    def stop_vms(self):
        subprocess.run(["pkill", "-KILL", "-f", f"qemu-system.*{self.dir}/"], check=False)

    def close(self):
        if self.server is not None:
            self.server.send_signal(signal.SIGTERM)
            self.server.wait(timeout=30)
        self.stop_vms()
        # The image daemon leaves once unused; do not wait for it.
        subprocess.run(["pkill", "-f", f"image nbd-daemon --data-dir {self.dir}$"], check=False)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture()
def host():
    made = []

    def make(name, cache_max=CACHE_MAX):
        h = Host(name, cache_max)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def check_files(sandbox, sums):
    cmd = "cd / && find " + " ".join(READ_DIRS) + " -xdev -type f -print0 | xargs -0 sha256sum"
    out = sandbox.commands.run(cmd, user="root", timeout=900).stdout
    got = {}
    for line in out.splitlines():
        h, name = line.split(maxsplit=1)
        got[name] = h
    assert len(got) == len(sums) and len(got) > 500
    bad = [n for n in sums if got.get(n) != sums[n]]
    assert not bad, f"{len(bad)} files differ, e.g. {bad[:3]}"


def test_lazy_start_with_a_cache_smaller_than_the_image(images, host):
    (v1, v2), sums = images
    b = host("e2e-lazy")
    code, _, err = b.tine("image", "pull", v1)
    assert code == 0, err
    assert "converted in its registry" in err, err
    stored = b.meta(v1)["chunks"]["stored_bytes"]
    assert stored > 4 * CACHE_MAX, "the image must be far larger than the cache"
    code, _, err = b.tine("template", "build", "lazy1", "--from-image", v1, "--vcpus", "1", "--memory-mib", "256",
                          "--config", b.config)
    assert code == 0, err
    # Booting and building fetched a small part of the image.
    st = b.stats()
    assert 0 < st["fetched_bytes"] < stored // 2, st
    assert st["cached_bytes"] <= st["max_bytes"] == CACHE_MAX, st

    b.serve()
    with b.sdk():
        s = Sandbox.create("lazy1", timeout=900)
        try:
            assert s.commands.run("cat /opt/img/keep /opt/img/which").stdout == "keptone"
            assert s.commands.run("whoami").stdout.strip() == "user"
            check_files(s, sums)
        finally:
            s.kill()
        st = b.stats()
        assert st["errors"] == 0 and st["evictions"] > 0, st
        assert st["cached_bytes"] <= CACHE_MAX, st
        # A second image, through the same bounded cache.
        code, _, err = b.tine("template", "build", "lazy2", "--from-image", v2, "--vcpus", "1",
                              "--memory-mib", "256")
        assert code == 0, err
        s = Sandbox.create("lazy2", timeout=900)
        try:
            assert s.commands.run("cat /opt/img/which").stdout == "two"
            check_files(s, sums)
        finally:
            s.kill()
    st = b.stats()
    assert st["errors"] == 0 and st["cached_bytes"] <= CACHE_MAX, st
    on_disk = sum(e.stat().st_size for e in os.scandir(os.path.join(b.dir, "images/chunks/sha256")))
    assert on_disk <= CACHE_MAX, on_disk
    m = b.metrics()
    assert f'tine_image_cache_bytes{{kind="max"}} {CACHE_MAX}' in m, m
    assert 'tine_image_cache_reads{kind="miss"}' in m


def test_a_chunk_damaged_in_the_registry_is_named(images, registry, host):
    (v1, _), _ = images
    c = host("e2e-lazy-c", cache_max=1 << 30)
    code, _, err = c.tine("image", "pull", v1)
    assert code == 0 and "converted in its registry" in err, err
    index = json.load(open(os.path.join(c.dir, "images", c.meta(v1)["manifest_digest"].split(":")[1], "index.json")))
    chunk = max((x for x in index["chunks"] if x), key=lambda x: x["size"])
    with open(registry.blob_file(chunk["digest"]), "r+b") as f:
        f.seek(chunk["size"] // 2)
        byte = f.read(1)
        f.seek(chunk["size"] // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    try:
        code, _, err = c.tine("image", "fetch", v1)
        assert code != 0, err
        assert chunk["digest"] in err and "e2e/lazy:v1" in err and "match its digest" in err, err
        st = c.stats()
        assert st["errors"] >= 1 and chunk["digest"] in st["last_error"], st
    finally:
        with open(registry.blob_file(chunk["digest"]), "r+b") as f:
            f.seek(chunk["size"] // 2)
            f.write(byte)


def denied(err):
    return "not authorized" in err.lower() or "unauthorized" in err.lower()


def test_registry_credentials(host):
    """A registry with basic auth: no or wrong credentials are refused with
    a clear error; the request's or the config file's are used, for the
    pull, the push and a lazy host's chunk fetches."""
    r = Registry(auth=("me", "secret"))
    try:
        ref = f"{r.host}/e2e/private:v1"
        layer = tar_layer(lambda t: add(t, "opt/private", b"p" * 100000))
        r.push_image("e2e/private", "v1", [(layer, GZ)], dict(CONFIG))
        code, _, err = tine("image", "pull", ref)
        assert code != 0 and "e2e/private" in err and denied(err), err
        code, _, err = tine("image", "pull", "--username", "me", "--password", "wrong", ref)
        assert code != 0 and denied(err), err
        assert "wrong" not in err, "the password is never printed"
        cfg = os.path.join(r.dir, "tine.toml")
        with open(cfg, "w") as f:
            f.write(f'[registries]\ncredentials = {{ "{r.host}" = {{ username = "me", password = "secret" }} }}\n')
        code, _, err = tine("image", "pull", "--config", cfg, ref)
        assert code == 0, err
        code, _, err = tine("image", "push", ref)
        assert code != 0 and denied(err), err
        code, _, err = tine("image", "push", "--username", "me", "--password", "secret", ref)
        assert code == 0, err
        # Another host pulls it lazily with the request's credentials and
        # its daemon fetches the chunks with them.
        c = host("e2e-lazy-auth", cache_max=1 << 30)
        code, _, err = c.tine("image", "pull", "--username", "me", "--password", "secret", ref)
        assert code == 0 and "converted in its registry" in err, err
        auth = os.path.join(c.dir, "images", c.meta(ref)["manifest_digest"].split(":")[1], "auth.json")
        assert os.stat(auth).st_mode & 0o777 == 0o600
        code, _, err = c.tine("image", "fetch", ref)
        assert code == 0, err
        st = c.stats()
        assert st["errors"] == 0 and st["misses"] > 0, st
    finally:
        tine("image", "rm", f"{r.host}/e2e/private:v1")
        r.stop()
