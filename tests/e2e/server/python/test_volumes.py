"""Volumes through the real SDK's `Volume` API: create, list, get, destroy,
the content API (read, write, list, mkdir, stat, metadata, remove), team
scoping, tokens, the size limit (16 MiB in run.sh's config) and bad input.
Mounting into sandboxes: test_volume_mounts.py."""

import io
import os
import uuid

import pytest

e2b = pytest.importorskip("e2b")
if not hasattr(e2b, "Volume"):
    pytest.skip("this SDK version has no Volume API", allow_module_level=True)

from e2b import Volume  # noqa: E402
from e2b.exceptions import (  # noqa: E402
    AuthenticationException,
    NotFoundException,
    VolumeException,
)

from conftest import assert_error, http  # noqa: E402

DATA = os.environ["TINE_DATA_DIR"]
MAX = 16 << 20


def name(tag):
    return f"e2e-{tag}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def vol():
    v = Volume.create(name("vol"))
    yield v
    Volume.destroy(v.volume_id)


def data_dir(v):
    return os.path.join(DATA, "volumes", v.volume_id, "data")


def test_create_list_get_connect_destroy():
    n = name("life")
    v = Volume.create(n)
    assert v.volume_id and v.name == n and v.token
    assert (v.volume_id, n) in [(i.volume_id, i.name) for i in Volume.list()]
    info = Volume.get_info(v.volume_id)
    assert (info.volume_id, info.name, info.token) == (v.volume_id, n, v.token)
    again = Volume.connect(v.volume_id)
    again.write_file("/hello.txt", "hi")
    assert v.read_file("/hello.txt") == "hi"
    # A name is its team's: a second one is refused.
    with pytest.raises(VolumeException, match="409"):
        Volume.create(n)
    assert Volume.destroy(v.volume_id) is True
    assert Volume.destroy(v.volume_id) is False
    with pytest.raises(NotFoundException):
        Volume.get_info(v.volume_id)
    assert not os.path.exists(os.path.join(DATA, "volumes", v.volume_id))


def test_files_directories_and_metadata(vol):
    e = vol.write_file("/docs/readme.md", "# hello\n")
    assert (e.name, e.path, e.type.value, e.size) == ("readme.md", "/docs/readme.md", "file", 8)
    # Owned by the guest's `user` unless told otherwise.
    assert (e.uid, e.gid, e.mode) == (1000, 1000, 0o644)
    assert vol.read_file("/docs/readme.md") == "# hello\n"
    blob = os.urandom(3 << 20)
    vol.write_file("/data/blob.bin", io.BytesIO(blob), mode=0o600, uid=0, gid=0)
    assert vol.read_file("/data/blob.bin", format="bytes") == blob
    assert b"".join(vol.read_file("/data/blob.bin", format="stream")) == blob
    st = vol.get_info("/data/blob.bin")
    assert (st.size, st.mode, st.uid) == (len(blob), 0o600, 0)
    # Replacing a file.
    vol.write_file("/docs/readme.md", "v2")
    assert vol.read_file("/docs/readme.md") == "v2"
    # Directories: parents only with force, an existing one refused.
    with pytest.raises(NotFoundException):
        vol.make_dir("/a/b/c")
    d = vol.make_dir("/a/b/c", force=True)
    assert (d.type.value, d.path) == ("directory", "/a/b/c")
    with pytest.raises(VolumeException, match="409"):
        vol.make_dir("/a/b/c")
    top = {e.path: e.type.value for e in vol.list("/")}
    assert top == {"/a": "directory", "/data": "directory", "/docs": "directory"}
    deep = [e.path for e in vol.list("/", depth=3)]
    assert {"/a/b", "/a/b/c", "/docs/readme.md", "/data/blob.bin"} <= set(deep)
    # Metadata.
    m = vol.update_metadata("/docs/readme.md", mode=0o640)
    assert m.mode == 0o640
    assert vol.exists("/docs/readme.md") and not vol.exists("/nope")
    # Remove a file, then a directory with what is in it.
    vol.remove("/docs/readme.md")
    assert not vol.exists("/docs/readme.md")
    vol.remove("/a")
    assert not vol.exists("/a/b/c")
    with pytest.raises(NotFoundException):
        vol.get_info("/a")
    # On the host: the files are where the docs say, nothing else.
    assert sorted(os.listdir(data_dir(vol))) == ["data", "docs"]


def test_the_size_limit_refuses_a_write_whole_and_keeps_what_was_there(vol):
    first = os.urandom(10 << 20)
    vol.write_file("/one.bin", first)
    with pytest.raises(VolumeException, match="507"):
        vol.write_file("/two.bin", os.urandom(10 << 20))
    assert not vol.exists("/two.bin")
    assert vol.read_file("/one.bin", format="bytes") == first
    # Replacing counts the file it replaces.
    bigger = os.urandom(12 << 20)
    vol.write_file("/one.bin", bigger)
    assert vol.read_file("/one.bin", format="bytes") == bigger
    # Past the limit in one upload.
    with pytest.raises(VolumeException, match="507"):
        vol.write_file("/huge.bin", io.BytesIO(os.urandom(MAX + 1)))
    # Removing frees the room.
    vol.remove("/one.bin")
    vol.write_file("/two.bin", os.urandom(10 << 20))
    # Nothing half written stays behind.
    assert os.listdir(os.path.join(DATA, "volumes", vol.volume_id, "tmp")) == []


def test_paths_cannot_leave_the_volume(vol, tmp_path):
    secret = tmp_path / "host-secret"
    secret.write_text("host only")
    vol.write_file("/in.txt", "inside")
    for bad in ("../../etc/passwd", "/a/../../x", "/../in.txt"):
        with pytest.raises(VolumeException, match="400"):
            vol.read_file(bad)
        with pytest.raises(VolumeException, match="400"):
            vol.write_file(bad, "x")
    # Symlinks a sandbox could write: out of the volume (absolute and
    # relative) are refused; inside it they work.
    d = data_dir(vol)
    os.symlink(str(secret), os.path.join(d, "abs"))
    os.symlink("../../../../../../../" + str(secret), os.path.join(d, "rel"))
    os.symlink("/", os.path.join(d, "root"))
    os.symlink("in.txt", os.path.join(d, "ok"))
    for link in ("/abs", "/rel", "/root/etc/passwd"):
        with pytest.raises(VolumeException, match="400.*leads out"):
            vol.read_file(link)
    with pytest.raises(VolumeException, match="400"):
        vol.write_file("/root/tmp/escaped", "x")
    assert not os.path.exists("/tmp/escaped")
    assert vol.read_file("/ok") == "inside"
    st = vol.get_info("/abs")
    assert (st.type.value, st.target) == ("symlink", str(secret))
    # Removing a symlink removes the link, not what it names.
    vol.remove("/abs")
    vol.remove("/root")
    assert secret.read_text() == "host only" and os.path.isdir("/etc")
    # Metadata never follows a symlink out either.
    with pytest.raises(VolumeException, match="400"):
        vol.update_metadata("/rel", mode=0o777)
    assert (os.stat(secret).st_mode & 0o777) != 0o777


def test_tokens_and_teams(vol, other_key):
    vol.write_file("/t.txt", "team")
    # A wrong token reads nothing.
    forged = Volume(vol.volume_id, vol.name, token="vt_" + "0" * 40)
    with pytest.raises(AuthenticationException):
        forged.read_file("/t.txt")
    assert_error(http("GET", f"/volumecontent/{vol.volume_id}/file?path=/t.txt"), 401)
    # Another team neither sees nor destroys it.
    assert vol.volume_id not in [v.volume_id for v in Volume.list(api_key=other_key)]
    with pytest.raises(NotFoundException):
        Volume.get_info(vol.volume_id, api_key=other_key)
    assert Volume.destroy(vol.volume_id, api_key=other_key) is False
    # The same name is free in another team.
    theirs = Volume.create(vol.name, api_key=other_key)
    assert theirs.volume_id != vol.volume_id
    # That team's volumes are capped smaller ([teams.vol-other] in run.sh).
    with pytest.raises(VolumeException, match="507|full"):
        theirs.write_file("/big.bin", b"\0" * (2 << 20))
    theirs.write_file("/small.bin", b"\0" * (512 << 10))
    assert Volume.destroy(theirs.volume_id, api_key=other_key)
    assert vol.read_file("/t.txt") == "team"


def test_bad_requests_get_clear_errors(vol):
    with pytest.raises(VolumeException, match="400"):
        Volume.create("no spaces allowed")
    r = http("POST", "/volumes", body=b"{not json", headers={"Content-Type": "application/json"})
    assert_error(r, 400)
    assert b"invalid JSON body" in r[2]
    with pytest.raises(NotFoundException):
        vol.read_file("/missing.txt")
    with pytest.raises(VolumeException, match="400"):
        vol.read_file("/")
    with pytest.raises(VolumeException, match="400"):
        vol.remove("/")
