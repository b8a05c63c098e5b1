"""Sandbox.list through the real Python SDK: metadata and state filters,
and v2 paging (x-next-token)."""

import pytest
from e2b import Sandbox, SandboxQuery, SandboxState

from conftest import RUN, new_sandbox

GROUP = {"tine-e2e": RUN, "group": "list"}
ODD = {"k y/é": "a&b=c %"}  # must survive the SDK's double encoding


@pytest.fixture(scope="module")
def three():
    made = [new_sandbox(metadata={"group": "list"}) for _ in range(2)]
    made.append(new_sandbox(metadata={"group": "list", **ODD}))
    yield made
    for s in made:
        s.kill()


def all_pages(paginator):
    pages = []
    while paginator.has_next:
        pages.append(paginator.next_items())
    return pages


def test_metadata_filter(three):
    got = [i for p in all_pages(Sandbox.list(query=SandboxQuery(metadata=GROUP))) for i in p]
    assert sorted(i.sandbox_id for i in got) == sorted(s.sandbox_id for s in three)
    for i in got:
        assert i.metadata["group"] == "list"
        assert i.state == SandboxState.RUNNING
        assert i.template_id == "base"
        assert i.cpu_count == 1 and i.memory_mb == 256

    none = all_pages(Sandbox.list(query=SandboxQuery(metadata={**GROUP, "group": "other"})))
    assert sum(len(p) for p in none) == 0


def test_metadata_filter_with_characters_the_sdk_escapes(three):
    # The SDK percent-encodes each key and value, urlencodes the pairs into
    # one string, and the HTTP client encodes that string again as a query
    # value: the server must undo all three.
    assert three[2].get_info().metadata == {**GROUP, **ODD}  # stored as sent
    odd = [i for p in all_pages(Sandbox.list(query=SandboxQuery(metadata={**GROUP, **ODD}))) for i in p]
    assert [i.sandbox_id for i in odd] == [three[2].sandbox_id]
    assert odd[0].metadata == {**GROUP, **ODD}


def test_state_filter(three):
    ids = {s.sandbox_id for s in three}
    running = Sandbox.list(query=SandboxQuery(metadata=GROUP, state=[SandboxState.RUNNING]))
    assert {i.sandbox_id for p in all_pages(running) for i in p} == ids
    paused = Sandbox.list(query=SandboxQuery(metadata=GROUP, state=[SandboxState.PAUSED]))
    assert not [i for p in all_pages(paused) for i in p]
    both = Sandbox.list(query=SandboxQuery(metadata=GROUP, state=[SandboxState.RUNNING, SandboxState.PAUSED]))
    assert {i.sandbox_id for p in all_pages(both) for i in p} == ids


def test_paging_with_limit(three):
    ids = {s.sandbox_id for s in three}
    pages = all_pages(Sandbox.list(query=SandboxQuery(metadata=GROUP), limit=2))
    assert [len(p) for p in pages] == [2, 1]
    seen = [i.sandbox_id for p in pages for i in p]
    assert len(seen) == len(set(seen)) == 3
    assert set(seen) == ids

    one_by_one = all_pages(Sandbox.list(query=SandboxQuery(metadata=GROUP), limit=1))
    assert [len(p) for p in one_by_one] == [1, 1, 1]
    assert {i.sandbox_id for p in one_by_one for i in p} == ids


def test_order(three):
    import inspect

    if "order" not in inspect.signature(Sandbox.list).parameters:
        pytest.skip("this SDK's Sandbox.list has no order")
    asc = [i for p in all_pages(Sandbox.list(query=SandboxQuery(metadata=GROUP), order="asc", limit=2)) for i in p]
    desc = [i for p in all_pages(Sandbox.list(query=SandboxQuery(metadata=GROUP), order="desc", limit=2)) for i in p]
    assert [i.sandbox_id for i in asc] == [i.sandbox_id for i in reversed(desc)]
    assert [i.started_at for i in asc] == sorted(i.started_at for i in asc)


def test_killed_sandboxes_are_not_listed(three):
    s = new_sandbox(metadata={"group": "list-killed"})
    q = SandboxQuery(metadata={"tine-e2e": RUN, "group": "list-killed"})
    assert [i.sandbox_id for p in all_pages(Sandbox.list(query=q)) for i in p] == [s.sandbox_id]
    assert s.kill() is True
    assert [i for p in all_pages(Sandbox.list(query=q)) for i in p] == []
