"""commands.* and pty.* through the real Python SDK."""

import time

import pytest
from e2b import CommandExitException, PtySize, Sandbox


def test_run_foreground_captures_stdout_stderr_and_exit(sbx):
    r = sbx.commands.run("echo out; echo err >&2; exit 0")
    assert r.stdout == "out\n"
    assert r.stderr == "err\n"
    assert r.exit_code == 0


def test_run_nonzero_exit_raises_with_output(sbx):
    with pytest.raises(CommandExitException) as exc:
        sbx.commands.run("echo partial; exit 7")
    assert exc.value.exit_code == 7
    assert exc.value.stdout == "partial\n"


def test_default_user_login_environment(sbx):
    r = sbx.commands.run('id -un; echo "$HOME|$USER|$SHELL"; pwd')
    lines = r.stdout.splitlines()
    assert lines[0] == "user"
    assert lines[1] == "/home/user|user|/bin/bash"
    assert lines[2] == "/home/user"


def test_run_as_root_and_env_and_cwd(sbx):
    r = sbx.commands.run("id -u; echo $FOO; pwd", user="root", envs={"FOO": "bar"}, cwd="/tmp")
    assert r.stdout.splitlines() == ["0", "bar", "/tmp"]


def test_unknown_user_is_rejected(sbx):
    with pytest.raises(Exception) as exc:
        sbx.commands.run("true", user="no-such-user-tine")
    assert "invalid username" in str(exc.value)


def test_large_fast_output_is_complete_and_ordered(sbx):
    r = sbx.commands.run("seq 1 200000")
    nums = r.stdout.split()
    assert len(nums) == 200000
    assert nums[0] == "1" and nums[-1] == "200000"
    assert nums == [str(i) for i in range(1, 200001)]


def test_background_list_and_kill(sbx):
    h = sbx.commands.run("sleep 300", background=True)
    assert h.pid in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(h.pid) is True
    with pytest.raises(CommandExitException) as exc:
        h.wait()
    assert exc.value.exit_code == -1
    assert h.pid not in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(h.pid) is False


def test_stdin_send_and_close(sbx):
    h = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.send_stdin(h.pid, "hello ")
    sbx.commands.send_stdin(h.pid, "world\n")
    sbx.commands.close_stdin(h.pid)
    r = h.wait()
    assert r.stdout == "hello world\n"


def test_stream_input(sbx):
    h = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.stream_input(h.pid, iter([b"a", "b", b"c\n"]))
    sbx.commands.close_stdin(h.pid)
    assert h.wait().stdout == "abc\n"


def test_connect_from_a_second_client(sbx):
    h = sbx.commands.run(
        "for i in 1 2 3; do echo line$i; sleep 0.5; done; echo done", background=True
    )
    other = Sandbox.connect("debug_sandbox_id")
    h2 = other.commands.connect(h.pid)
    r2 = h2.wait()
    assert "done\n" in r2.stdout
    assert r2.exit_code == 0
    r1 = h.wait()
    assert r1.stdout == "line1\nline2\nline3\ndone\n"


def test_process_outlives_client_disconnect(sbx):
    h = sbx.commands.run("sleep 3; echo ok", background=True)
    pid = h.pid
    h.disconnect()
    r = Sandbox.connect("debug_sandbox_id").commands.connect(pid).wait()
    assert r.exit_code == 0
    assert "ok" in r.stdout


def test_connect_to_missing_pid_fails(sbx):
    with pytest.raises(Exception):
        sbx.commands.connect(999999).wait()


def test_timeout_kills_the_process(sbx):
    start = sbx.commands.run("sleep 30", background=True, timeout=1)
    with pytest.raises(Exception):
        start.wait()
    # The agent kills it at its Connect-Timeout-Ms deadline (the client
    # gives up at the same moment, so poll rather than race it).
    for _ in range(100):
        if start.pid not in [p.pid for p in sbx.commands.list()]:
            break
        time.sleep(0.1)
    assert start.pid not in [p.pid for p in sbx.commands.list()]


def test_pty_create_resize_and_input(sbx):
    out = []
    t = sbx.pty.create(PtySize(cols=80, rows=24))
    sbx.pty.resize(t.pid, PtySize(cols=123, rows=45))
    sbx.pty.send_stdin(t.pid, b"stty size; tty; exit\n")
    r = t.wait(on_pty=lambda d: out.append(d))
    text = b"".join(out).decode(errors="replace")
    assert "45 123" in text
    assert "/dev/pts/" in text
    assert r.exit_code == 0


def test_pty_kill(sbx):
    t = sbx.pty.create(PtySize(cols=80, rows=24))
    assert sbx.pty.kill(t.pid) is True
    with pytest.raises(Exception):
        t.wait()


def test_is_running(sbx):
    assert sbx.is_running() is True


async def test_async_run_with_streaming_callbacks(asbx):
    chunks = []
    r = await asbx.commands.run("echo a; sleep 0.2; echo b", on_stdout=chunks.append)
    assert r.stdout == "a\nb\n"
    assert "".join(chunks) == "a\nb\n"
    h = await asbx.commands.run("sleep 300", background=True)
    assert await asbx.commands.kill(h.pid) is True
