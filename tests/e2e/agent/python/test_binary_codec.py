"""The agent with connectrpc's default codec: binary protobuf, and gzip
request compression (what other Connect clients use), through the
generated clients shipped in the e2b package."""

import base64

import pytest

connectrpc = pytest.importorskip("connectrpc.errors", reason="this SDK has no connectrpc client (the binary codec tests need it)")
ConnectError = connectrpc.ConnectError
from e2b.envd.filesystem import filesystem_connect, filesystem_pb
from e2b.envd.process import process_connect, process_pb

from conftest import AGENT

ROOT = {"Authorization": "Basic " + base64.b64encode(b"root:").decode()}


def test_process_start_and_list_in_binary():
    with process_connect.ProcessClientSync(AGENT) as client:
        req = process_pb.StartRequest(process=process_pb.ProcessConfig(cmd="/bin/sh", args=["-c", "echo bin; echo err >&2; exit 2"], envs={"A": "b"}))
        # Each response's ProcessEvent holds its kind in the `event` oneof.
        events = [r.event.event for r in client.start(req, headers=ROOT)]
        assert events[0].field == "start" and events[0].value.pid > 0
        stdout = b"".join(e.value.output.value for e in events if e.field == "data" and e.value.output.field == "stdout")
        stderr = b"".join(e.value.output.value for e in events if e.field == "data" and e.value.output.field == "stderr")
        assert (stdout, stderr) == (b"bin\n", b"err\n")
        assert events[-1].field == "end"
        assert events[-1].value.exit_code == 2
        assert events[-1].value.status == "exit status 2"
        listed = client.list(process_pb.ListRequest(), headers=ROOT)
        assert isinstance(list(listed.processes), list)


def test_filesystem_in_binary(tmp_path):
    with filesystem_connect.FilesystemClientSync(AGENT) as client:
        (tmp_path / "f.txt").write_text("12345")
        r = client.stat(filesystem_pb.StatRequest(path=str(tmp_path / "f.txt")), headers=ROOT)
        assert r.entry.name == "f.txt"
        assert r.entry.size == 5
        assert r.entry.type == filesystem_pb.FileType.FILE
        assert r.entry.modified_time.to_datetime().year >= 2024
        listed = client.list_dir(filesystem_pb.ListDirRequest(path=str(tmp_path), depth=1), headers=ROOT)
        assert [e.name for e in listed.entries] == ["f.txt"]
        try:
            client.stat(filesystem_pb.StatRequest(path=str(tmp_path / "missing")), headers=ROOT)
            raise AssertionError("expected not_found")
        except ConnectError as e:
            assert e.code.name == "NOT_FOUND"
