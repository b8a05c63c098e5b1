"""files.* through the real Python SDK."""

import gzip
import hashlib
import io
import os

import pytest
from e2b import FileType
from e2b.exceptions import InvalidArgumentException, NotFoundException

try:
    from e2b.exceptions import FileNotFoundException
except ImportError:  # SDKs before it raise NotFoundException
    FileNotFoundException = NotFoundException

from conftest import http


def test_write_read_text_and_bytes(sbx, tmpdir_in_sandbox):
    p = f"{tmpdir_in_sandbox}/a/b/hello.txt"
    info = sbx.files.write(p, "héllo")
    assert info.path == p and info.name == "hello.txt"
    assert sbx.files.read(p) == "héllo"
    sbx.files.write(p, b"\x00\xffbin")
    assert sbx.files.read(p, format="bytes") == b"\x00\xffbin"


def test_written_files_and_parents_belong_to_the_user(sbx, tmpdir_in_sandbox):
    p = f"{tmpdir_in_sandbox}/new/dir/f.txt"
    sbx.files.write(p, "x")
    for path in (p, f"{tmpdir_in_sandbox}/new/dir", f"{tmpdir_in_sandbox}/new"):
        assert sbx.files.get_info(path).owner == "user"
    assert sbx.files.write(f"/tmp/tine-e2e-root-{os.getpid()}", "r", user="root")
    assert sbx.files.get_info(f"/tmp/tine-e2e-root-{os.getpid()}").owner == "root"
    sbx.files.remove(f"/tmp/tine-e2e-root-{os.getpid()}", user="root")


def test_write_files_several_at_once(sbx, tmpdir_in_sandbox):
    infos = sbx.files.write_files(
        [
            {"path": f"{tmpdir_in_sandbox}/one.txt", "data": "1"},
            {"path": f"{tmpdir_in_sandbox}/sub/two.bin", "data": b"2"},
            {"path": f"{tmpdir_in_sandbox}/three.txt", "data": io.BytesIO(b"3")},
        ]
    )
    assert [i.name for i in infos] == ["one.txt", "two.bin", "three.txt"]
    assert sbx.files.read(f"{tmpdir_in_sandbox}/sub/two.bin") == "2"
    assert sbx.files.read(f"{tmpdir_in_sandbox}/three.txt") == "3"


def test_gzip_and_stream_uploads(sbx, tmpdir_in_sandbox):
    p = f"{tmpdir_in_sandbox}/gz.txt"
    sbx.files.write(p, "compressed " * 1000, gzip=True)
    assert sbx.files.read(p) == "compressed " * 1000
    q = f"{tmpdir_in_sandbox}/it.bin"
    sbx.files.write(q, iter([b"ab", b"cd"]))
    assert sbx.files.read(q) == "abcd"


def test_list_with_depth_and_entry_info(sbx, tmpdir_in_sandbox):
    sbx.files.write(f"{tmpdir_in_sandbox}/f.txt", "12345")
    sbx.files.write(f"{tmpdir_in_sandbox}/d/inner.txt", "x")
    sbx.commands.run(f"ln -s f.txt {tmpdir_in_sandbox}/link")
    names = sorted(e.name for e in sbx.files.list(tmpdir_in_sandbox))
    assert names == ["d", "f.txt", "link"]
    deep = {e.path: e for e in sbx.files.list(tmpdir_in_sandbox, depth=2)}
    assert f"{tmpdir_in_sandbox}/d/inner.txt" in deep
    f = deep[f"{tmpdir_in_sandbox}/f.txt"]
    assert f.type == FileType.FILE and f.size == 5
    assert f.permissions == "-rw-r--r--" and f.mode == 0o644
    assert f.owner == "user" and f.group == "user"
    assert f.modified_time.year >= 2024
    d = deep[f"{tmpdir_in_sandbox}/d"]
    assert d.type == FileType.DIR
    link = sbx.files.get_info(f"{tmpdir_in_sandbox}/link")
    assert link.symlink_target == f"{tmpdir_in_sandbox}/f.txt"


def test_exists_get_info_remove_rename_make_dir(sbx, tmpdir_in_sandbox):
    p = f"{tmpdir_in_sandbox}/x.txt"
    assert not sbx.files.exists(p)
    sbx.files.write(p, "x")
    assert sbx.files.exists(p)
    moved = sbx.files.rename(p, f"{tmpdir_in_sandbox}/deeper/y.txt")
    assert moved.path == f"{tmpdir_in_sandbox}/deeper/y.txt"
    assert not sbx.files.exists(p)
    assert sbx.files.make_dir(f"{tmpdir_in_sandbox}/m/n") is True
    assert sbx.files.make_dir(f"{tmpdir_in_sandbox}/m/n") is False
    sbx.files.remove(f"{tmpdir_in_sandbox}/deeper")
    assert not sbx.files.exists(f"{tmpdir_in_sandbox}/deeper/y.txt")


def test_missing_paths(sbx, tmpdir_in_sandbox):
    with pytest.raises(FileNotFoundException):
        sbx.files.read(f"{tmpdir_in_sandbox}/missing")
    with pytest.raises((FileNotFoundException, NotFoundException)):
        sbx.files.get_info(f"{tmpdir_in_sandbox}/missing")
    with pytest.raises((FileNotFoundException, NotFoundException)):
        sbx.files.list(f"{tmpdir_in_sandbox}/missing")
    with pytest.raises((FileNotFoundException, NotFoundException)):
        sbx.files.rename(f"{tmpdir_in_sandbox}/missing", f"{tmpdir_in_sandbox}/x")
    # Removing a path that does not exist succeeds, as in E2B.
    sbx.files.remove(f"{tmpdir_in_sandbox}/missing")
    sbx.files.remove(f"{tmpdir_in_sandbox}/missing/deeper")


def test_reading_a_directory_is_invalid(sbx, tmpdir_in_sandbox):
    with pytest.raises(InvalidArgumentException):
        sbx.files.read(tmpdir_in_sandbox)


def test_file_calls_run_as_root_like_envd(sbx):
    # envd serves file calls as root: the user only resolves paths and owns
    # what is created, so a root-only file is readable as the default user.
    sbx.files.write("/tmp/tine-e2e-secret", "s", user="root")
    sbx.commands.run("chmod 600 /tmp/tine-e2e-secret", user="root")
    assert sbx.files.read("/tmp/tine-e2e-secret") == "s"
    assert sbx.files.read("/tmp/tine-e2e-secret", user="root") == "s"
    # A procfs file (stat says 0 bytes) is read to its end.
    assert sbx.files.read("/proc/self/status").startswith("Name:")
    sbx.files.remove("/tmp/tine-e2e-secret", user="root")


def test_100_mib_upload_and_download_with_checksum(sbx, tmpdir_in_sandbox):
    size = 100 << 20
    block = os.urandom(1 << 20)
    data_hash = hashlib.sha256()

    def chunks():
        for i in range(size // len(block)):
            chunk = bytes([i % 256]) + block[1:]
            data_hash.update(chunk)
            yield chunk

    p = f"{tmpdir_in_sandbox}/big.bin"
    sbx.files.write(p, chunks())
    assert sbx.files.get_info(p).size == size
    # The agent's view of the file matches what was sent...
    remote = sbx.commands.run(f"sha256sum {p}").stdout.split()[0]
    assert remote == data_hash.hexdigest()
    # ...and so does a streamed download.
    down = hashlib.sha256()
    n = 0
    for chunk in sbx.files.read(p, format="stream"):
        down.update(chunk)
        n += len(chunk)
    assert n == size
    assert down.hexdigest() == data_hash.hexdigest()
    # Neither direction held the file in the agent's memory.
    peak = _agent_peak_rss()
    if peak is not None:
        assert peak < 64 << 20, f"agent peak RSS {peak >> 20} MiB after moving 100 MiB"


def _agent_peak_rss():
    pid = os.environ.get("TINE_AGENT_PID")
    if not pid:
        return None
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


def test_multipart_upload_of_a_large_file(sbx, tmpdir_in_sandbox):
    data = os.urandom(8 << 20)
    p = f"{tmpdir_in_sandbox}/multi.bin"
    sbx.files.write(p, data, use_octet_stream=False)
    assert hashlib.sha256(sbx.files.read(p, format="bytes")).digest() == hashlib.sha256(data).digest()


def test_raw_http_gzip_upload(tmpdir_in_sandbox):
    body = gzip.compress(b"zipped!")
    status, _, resp = http(
        "POST",
        f"/files?path={tmpdir_in_sandbox}/raw.txt",
        body,
        {"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"},
    )
    assert status == 200, resp
    status, headers, got = http("GET", f"/files?path={tmpdir_in_sandbox}/raw.txt")
    assert status == 200 and got == b"zipped!"


def test_metadata_headers_become_entry_metadata(sbx, tmpdir_in_sandbox):
    p = f"{tmpdir_in_sandbox}/meta.txt"
    info = sbx.files.write(p, "m", metadata={"Project": "tine", "k": "v"})
    assert info.metadata == {"project": "tine", "k": "v"}
    assert sbx.files.get_info(p).metadata == {"project": "tine", "k": "v"}
    # Overwriting with other metadata replaces the whole set.
    sbx.files.write(p, "m2", metadata={"only": "this"})
    assert sbx.files.get_info(p).metadata == {"only": "this"}
    listed = {e.name: e for e in sbx.files.list(tmpdir_in_sandbox)}
    assert listed["meta.txt"].metadata == {"only": "this"}
    # A write without metadata clears what the last one stored.
    sbx.files.write(p, "m3")
    assert sbx.files.get_info(p).metadata in ({}, None)
    assert sbx.files.read(p) == "m3"
