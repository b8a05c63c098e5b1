"""files.watch_dir: polled (sync SDK) and streamed (async SDK)."""

import asyncio
import time

import pytest
from e2b import FilesystemEventType


def _wait_for(pred, get, timeout=10.0):
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen.extend(get())
        if pred(seen):
            return seen
        time.sleep(0.1)
    return seen


def test_watch_dir_sync_recursive(sbx, tmpdir_in_sandbox):
    h = sbx.files.watch_dir(tmpdir_in_sandbox, recursive=True)
    try:
        sbx.files.write(f"{tmpdir_in_sandbox}/a.txt", "a")
        sbx.files.make_dir(f"{tmpdir_in_sandbox}/sub")
        # The new directory gets a watch too; wait until its create is seen.
        seen = _wait_for(lambda s: any(e.name == "sub" for e in s), h.get_new_events)
        sbx.files.write(f"{tmpdir_in_sandbox}/sub/b.txt", "b")
        sbx.files.rename(f"{tmpdir_in_sandbox}/a.txt", f"{tmpdir_in_sandbox}/c.txt")
        sbx.files.remove(f"{tmpdir_in_sandbox}/c.txt")
        want = {
            ("a.txt", FilesystemEventType.CREATE),
            ("a.txt", FilesystemEventType.WRITE),
            ("sub", FilesystemEventType.CREATE),
            ("sub/b.txt", FilesystemEventType.CREATE),
            ("a.txt", FilesystemEventType.RENAME),
            ("c.txt", FilesystemEventType.CREATE),
            ("c.txt", FilesystemEventType.REMOVE),
        }
        seen += _wait_for(lambda s: want <= {(e.name, e.type) for e in seen + s}, h.get_new_events)
        assert want <= {(e.name, e.type) for e in seen}
    finally:
        h.stop()


def test_watch_sees_envds_sequence_for_a_new_file(sbx, tmpdir_in_sandbox):
    h = sbx.files.watch_dir(tmpdir_in_sandbox)
    try:
        sbx.files.write(f"{tmpdir_in_sandbox}/seq.txt", "hello")
        want = [FilesystemEventType.CREATE, FilesystemEventType.WRITE, FilesystemEventType.CHMOD]
        seen = _wait_for(
            lambda s: len([e for e in s if e.name == "seq.txt"]) >= 3, h.get_new_events
        )
        assert [e.type for e in seen if e.name == "seq.txt"][:3] == want
    finally:
        h.stop()


def test_recursive_watch_reports_nested_paths_in_new_dirs(sbx, tmpdir_in_sandbox):
    h = sbx.files.watch_dir(tmpdir_in_sandbox, recursive=True)
    try:
        # No wait between: the file may land before the new directories'
        # watches are added, and must be reported all the same.
        sbx.files.make_dir(f"{tmpdir_in_sandbox}/n1/n2")
        sbx.files.write(f"{tmpdir_in_sandbox}/n1/n2/deep.txt", "x")
        seen = _wait_for(
            lambda s: any(e.name == "n1/n2/deep.txt" for e in s), h.get_new_events
        )
        names = {e.name for e in seen}
        assert {"n1", "n1/n2", "n1/n2/deep.txt"} <= names, names
        assert not any(n.startswith("/") for n in names)
    finally:
        h.stop()


def test_watch_dir_sync_non_recursive_ignores_subdirs(sbx, tmpdir_in_sandbox):
    sbx.files.make_dir(f"{tmpdir_in_sandbox}/sub")
    h = sbx.files.watch_dir(tmpdir_in_sandbox)
    try:
        sbx.files.write(f"{tmpdir_in_sandbox}/sub/deep.txt", "x")
        sbx.files.write(f"{tmpdir_in_sandbox}/top.txt", "x")
        seen = _wait_for(lambda s: any(e.name == "top.txt" for e in s), h.get_new_events)
        assert any(e.name == "top.txt" for e in seen)
        assert not any("deep" in e.name for e in seen)
    finally:
        h.stop()


def test_watch_missing_dir_fails(sbx):
    with pytest.raises(Exception):
        sbx.files.watch_dir("/tmp/tine-e2e-does-not-exist")


async def test_watch_dir_async_stream(asbx, tmpdir_in_sandbox):
    events = []
    handle = await asbx.files.watch_dir(tmpdir_in_sandbox, on_event=events.append, recursive=True)
    try:
        await asbx.files.write(f"{tmpdir_in_sandbox}/async.txt", "x")
        for _ in range(100):
            if any(e.name == "async.txt" and e.type == FilesystemEventType.WRITE for e in events):
                break
            await asyncio.sleep(0.1)
        assert ("async.txt", FilesystemEventType.CREATE) in [(e.name, e.type) for e in events]
        assert ("async.txt", FilesystemEventType.WRITE) in [(e.name, e.type) for e in events]
    finally:
        await handle.stop()


def test_watch_dir_include_entry(sbx, tmpdir_in_sandbox):
    h = sbx.files.watch_dir(tmpdir_in_sandbox, include_entry=True)
    try:
        sbx.files.write(f"{tmpdir_in_sandbox}/e.txt", "12345")
        seen = _wait_for(lambda s: any(e.name == "e.txt" and e.type == FilesystemEventType.WRITE for e in s), h.get_new_events)
        writes = [e for e in seen if e.name == "e.txt" and e.type == FilesystemEventType.WRITE]
        assert writes and writes[-1].entry is not None
        assert writes[-1].entry.path == f"{tmpdir_in_sandbox}/e.txt"
    finally:
        h.stop()
