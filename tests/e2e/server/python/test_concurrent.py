"""20 sandboxes created at once through the async SDK all work, and each
handle reaches its own VM."""

import asyncio

import pytest

from e2b import AsyncSandbox, Sandbox, SandboxQuery

from conftest import RUN, tagged

N = 20

# The server's concurrency, not the SDK's: run under the pinned SDK only.
pytestmark = pytest.mark.machinery


async def test_twenty_concurrent_sandboxes():
    async def one(i):
        s = await AsyncSandbox.create(metadata=tagged({"group": "concurrent", "n": str(i)}), envs={"N": str(i)})
        try:
            r = await s.commands.run('echo "$N" > /tmp/tine-n && cat /tmp/tine-n')
            return s, r
        except BaseException:
            await s.kill()
            raise

    results = await asyncio.gather(*(one(i) for i in range(N)), return_exceptions=True)
    made = [r[0] for r in results if not isinstance(r, BaseException)]
    try:
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, f"{len(errors)} of {N} failed: {errors[:3]!r}"
        assert len({s.sandbox_id for s, _ in results}) == N
        for i, (_, r) in enumerate(results):
            assert r.exit_code == 0
            assert r.stdout == f"{i}\n"
        # Only once all exist: each one still holds what it wrote itself.
        reads = await asyncio.gather(*(s.files.read("/tmp/tine-n") for s, _ in results))
        assert reads == [f"{i}\n" for i in range(N)]

        q = SandboxQuery(metadata={"tine-e2e": RUN, "group": "concurrent"})
        listed = set()
        p = Sandbox.list(query=q, limit=7)
        while p.has_next:
            listed |= {i.sandbox_id for i in p.next_items()}
        assert listed == {s.sandbox_id for s, _ in results}
    finally:
        killed = await asyncio.gather(*(s.kill() for s in made), return_exceptions=True)
    assert all(k is True for k in killed), killed
