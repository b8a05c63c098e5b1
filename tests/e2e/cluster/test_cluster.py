"""Cluster mode end to end: 3 nodes and 2 gateways from scripts/cluster.sh,
real PostgreSQL, real VMs, the real Python SDK pointed at a gateway.

The failure tests come last in the file (pytest keeps file order): they stop
nodes, a gateway and PostgreSQL, and put them back.
"""

import concurrent.futures
import hashlib
import json
import os
import re
import subprocess
import time
import uuid

import httpx
import pytest
from e2b import Sandbox, SandboxQuery, Template

GATEWAYS = os.environ["TINE_E2E_GATEWAYS"].split(",")
NODES = os.environ["TINE_E2E_NODES"].split(",")
KEY = os.environ["E2B_API_KEY"]
OTHER_KEY = os.environ["TINE_E2E_OTHER_KEY"]
LIMITED_KEY = os.environ["TINE_E2E_LIMITED_KEY"]
CLUSTER = os.path.join(os.path.dirname(__file__), "..", "..", "..", "scripts", "cluster.sh")
RUN = uuid.uuid4().hex[:10]


def api(method, path, key=KEY, gateway=GATEWAYS[0], **kw):
    return httpx.request(method, gateway + path, headers={"X-API-KEY": key}, timeout=120, **kw)


def node_of(sandbox_id):
    r = api("GET", f"/sandboxes/{sandbox_id}")
    assert r.status_code == 200, r.text
    return r.json()["nodeID"]


def cluster(*args):
    subprocess.run(["bash", CLUSTER, *args], check=True, timeout=300)


def create(**kw):
    kw.setdefault("metadata", {})["run"] = RUN
    return Sandbox.create(timeout=600, **kw)


@pytest.fixture(scope="module")
def spread():
    """12 sandboxes made through the first gateway, killed at the end."""
    sbs = [create(metadata={"i": str(i)}) for i in range(12)]
    yield sbs
    for s in sbs:
        try:
            s.kill()
        except Exception:
            pass


def test_creates_spread_over_every_node_and_each_sandbox_answers_through_either_gateway(spread):
    nodes = {s.sandbox_id: node_of(s.sandbox_id) for s in spread}
    assert set(nodes.values()) == {"node-1", "node-2", "node-3"}, nodes
    for s in spread[:6]:
        out = s.commands.run("echo hi from $(hostname)")
        assert out.stdout.strip() == f"hi from {s.sandbox_id}"
    # The second gateway routes them too (envd and REST).
    s = spread[0]
    other = Sandbox.connect(s.sandbox_id, api_url=GATEWAYS[1], sandbox_url=GATEWAYS[1])
    other.files.write("/tmp/through-gateway-2", "written via gateway 2")
    assert s.files.read("/tmp/through-gateway-2") == "written via gateway 2"
    assert api("GET", f"/sandboxes/{s.sandbox_id}", gateway=GATEWAYS[1]).json()["nodeID"] == nodes[s.sandbox_id]


def test_the_console_through_a_gateway_shows_every_host_and_where_sandboxes_run(spread):
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from browser import By, chromium, go, sign_in, wait

    r = httpx.get(GATEWAYS[1] + "/console")
    assert r.status_code == 200 and "script-src 'self'" in r.headers["content-security-policy"]
    hosts = api("GET", "/hosts").json()
    assert sorted(h["nodeID"] for h in hosts) == ["node-1", "node-2", "node-3"], hosts
    assert all(h["up"] and h["capacity"] > 0 and h["heartbeatAgeMs"] < 15000 for h in hosts), hosts
    assert api("GET", "/hosts", key="e2b_nope").status_code == 401
    # Lists name each sandbox's node, as its detail does.
    listed = api("GET", f"/v2/sandboxes?metadata=run%3D{RUN}&limit=100").json()
    assert {x["sandboxID"]: x["nodeID"] for x in listed if x["sandboxID"] in {s.sandbox_id for s in spread}} == \
        {s.sandbox_id: node_of(s.sandbox_id) for s in spread}
    s = spread[0]
    events = api("GET", f"/sandboxes/{s.sandbox_id}/events", gateway=GATEWAYS[1]).json()
    assert any(e["kind"] == "create" for e in events), events
    assert api("GET", "/builds").status_code == 200
    d = chromium()
    try:
        sign_in(d, GATEWAYS[1] + "/console", KEY)
        go(d, "#/hosts")
        wait(d, lambda: len(d.find_elements(By.CSS_SELECTOR, "#hosts tr[data-host]")) == 3, what="three hosts")
        go(d, f"#/sandbox/{s.sandbox_id}")
        wait(d, lambda: node_of(s.sandbox_id) in d.find_element(By.ID, "sandbox-info").text, what="the node")
    finally:
        d.quit()


def test_list_pages_and_filters_across_nodes_and_teams(spread):
    ids = {s.sandbox_id for s in spread}
    listed = Sandbox.list(query=SandboxQuery(metadata={"run": RUN}))
    seen = []
    while listed.has_next:
        seen += [x.sandbox_id for x in listed.next_items()]
    assert set(seen) == ids and len(seen) == len(ids)
    # Pages of 5: 5, 5, 2, with the node's own paging token.
    pages = []
    token = None
    while True:
        params = {"metadata": f"run={RUN}", "limit": 5}
        if token:
            params["nextToken"] = token
        r = api("GET", "/v2/sandboxes", params=params)
        assert r.status_code == 200, r.text
        pages.append([x["sandboxID"] for x in r.json()])
        token = r.headers.get("x-next-token")
        if not token:
            break
    assert [len(p) for p in pages] == [5, 5, 2]
    assert {i for p in pages for i in p} == ids
    one = api("GET", "/v2/sandboxes", params={"metadata": f"run={RUN}&i=3"}).json()
    assert [x["metadata"]["i"] for x in one] == ["3"]
    # Another team sees none of them, and cannot reach one by id.
    assert api("GET", "/v2/sandboxes", key=OTHER_KEY).json() == []
    r = api("GET", f"/sandboxes/{spread[0].sandbox_id}", key=OTHER_KEY)
    assert r.status_code == 404 and r.json()["code"] == 404


def test_fork_children_land_on_the_source_node(spread):
    src = spread[1]
    src.commands.run("echo parent > /tmp/state")
    r = api("POST", f"/sandboxes/{src.sandbox_id}/fork", json={"count": 2})
    assert r.status_code == 201, r.text
    children = [x["sandbox"]["sandboxID"] for x in r.json()]
    assert len(children) == 2
    try:
        for c in children:
            assert node_of(c) == node_of(src.sandbox_id)
            sb = Sandbox.connect(c)
            assert sb.commands.run("cat /tmp/state").stdout.strip() == "parent"
    finally:
        for c in children:
            api("DELETE", f"/sandboxes/{c}")


def test_a_snapshot_held_by_one_node_gets_its_sandboxes_there_through_either_gateway(spread):
    src = spread[5]
    src.commands.run("echo from the snapshot > /tmp/snap")
    snap = src.create_snapshot()
    n = node_of(src.sandbox_id)
    made = []
    try:
        # At once, through the gateway that took the snapshot and the other.
        for i in range(4):
            r = api(
                "POST",
                "/v2/sandboxes",
                gateway=GATEWAYS[i % 2],
                json={"templateID": snap.snapshot_id, "timeout": 300, "metadata": {"run": RUN}},
            )
            assert r.status_code == 201, r.text
            made.append(r.json()["sandboxID"])
        for c in made:
            assert node_of(c) == n
        sb = Sandbox.connect(made[-1])
        assert sb.commands.run("cat /tmp/snap").stdout.strip() == "from the snapshot"
    finally:
        for c in made:
            api("DELETE", f"/sandboxes/{c}")
        Sandbox.delete_snapshot(snap.snapshot_id)


def test_a_change_a_node_makes_on_its_own_reaches_every_gateways_list_before_its_next_full_list():
    # The node kills it when its 3 s run out; nothing goes through a
    # gateway. cluster.sh's nodes publish their full list every 5 minutes.
    s = create()
    s.set_timeout(3)
    seen_by = {}
    deadline = time.time() + 15
    while time.time() < deadline and len(seen_by) < 2:
        for g in GATEWAYS:
            ids = {x["sandboxID"] for x in api("GET", "/v2/sandboxes", gateway=g, params={"metadata": f"run={RUN}"}).json()}
            if s.sandbox_id not in ids:
                seen_by.setdefault(g, time.time())
        time.sleep(0.5)
    assert set(seen_by) == set(GATEWAYS), "the timed-out sandbox is still listed"


def test_bad_input_gets_clear_errors():
    # A user's key straight to a node: refused, with the way to go.
    r = httpx.get(NODES[0] + "/v2/sandboxes", headers={"X-API-KEY": KEY})
    assert r.status_code == 401 and "gateway" in r.json()["message"]
    # A wrong cluster secret.
    r = httpx.get(
        NODES[0] + "/v2/sandboxes",
        headers={"x-tine-cluster-secret": "0" * 64, "x-tine-team": "default"},
    )
    assert r.status_code == 401 and r.json()["message"] == "wrong cluster secret"
    # A bad key, no key, an unknown sandbox (REST and envd).
    assert api("GET", "/v2/sandboxes", key="e2b_" + "0" * 40).status_code == 401
    assert httpx.get(GATEWAYS[0] + "/v2/sandboxes").status_code == 401
    r = api("GET", "/sandboxes/inope0000000000000000")
    assert r.status_code == 404 and r.json()["code"] == 404
    r = httpx.get(GATEWAYS[0] + "/health", headers={"E2b-Sandbox-Id": "inope0000000000000000"})
    assert r.status_code == 502
    assert r.json() == {"message": "The sandbox was not found", "sandboxId": "inope0000000000000000", "code": 502}
    # Malformed JSON reaches a node and gets its 400.
    r = api("POST", "/v2/sandboxes", content=b"{not json")
    assert r.status_code == 400 and r.json()["code"] == 400


def test_a_request_naming_no_sandbox_is_not_read_before_a_node_knows_it(spread):
    """An anonymous client declares a 10 MB body on a signed-looking URL (and
    on an envd path with a made-up token) and sends none of it: the gateway
    answers from the nodes' verdict on the head alone, holding nothing."""
    import socket
    host, port = GATEWAYS[0].split("//")[1].rsplit(":", 1)
    for head in (
        b"POST /files?path=/tmp/x&username=user&signature=v1_forged HTTP/1.1\r\n",
        b"POST /filesystem.Filesystem/ListDir HTTP/1.1\r\nX-Access-Token: made-up\r\n",
    ):
        with socket.create_connection((host, int(port)), timeout=30) as c:
            c.sendall(head + f"Host: {host}\r\nContent-Length: {10 << 20}\r\n\r\n".encode())
            c.settimeout(30)
            answer = c.recv(4096)
        status = answer.split(b"\r\n", 1)[0]
        assert status in (b"HTTP/1.1 401 Unauthorized", b"HTTP/1.1 502 Bad Gateway"), answer[:300]
        assert b"x-tine-" not in answer.lower(), answer[:600]
    # A real signed URL still reaches its sandbox through the gateway.
    s = spread[0]
    s.files.write("/tmp/signed.txt", "through the gateway")
    r = httpx.get(s.download_url("/tmp/signed.txt"), timeout=60)
    assert r.status_code == 200 and r.text == "through the gateway", r.text
    assert r.headers["content-disposition"].startswith("attachment")


def test_a_revoked_key_is_refused_by_every_gateway_within_10_s():
    tine = os.environ["TINE_BIN"]
    p = subprocess.run(
        [tine, "cluster", "create-key", "--name", f"revoke-{RUN}"], capture_output=True, text=True, check=True
    )
    key = p.stdout.strip()
    key_id = p.stderr.split("created key ")[1].split()[0]
    for g in GATEWAYS:
        assert api("GET", "/v2/sandboxes", key=key, gateway=g).status_code == 200
    subprocess.run([tine, "cluster", "revoke-key", key_id], check=True, capture_output=True)
    time.sleep(11)
    for g in GATEWAYS:
        r = api("GET", "/v2/sandboxes", key=key, gateway=g)
        assert r.status_code == 401 and r.json()["message"] == "invalid API key"
    p = subprocess.run([tine, "cluster", "revoke-key", key_id], capture_output=True, text=True)
    assert p.returncode != 0 and "no key" in p.stderr


def test_two_gateways_racing_never_exceed_a_teams_limit():
    def one(i):
        return api(
            "POST",
            "/v2/sandboxes",
            key=LIMITED_KEY,
            gateway=GATEWAYS[i % 2],
            json={"templateID": "base", "timeout": 300, "metadata": {"run": RUN}},
        )

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(one, range(6)))
    made = [a.json()["sandboxID"] for a in answers if a.status_code == 201]
    try:
        assert len(made) == 2, [(a.status_code, a.text[:120]) for a in answers]
        assert all(a.status_code in (201, 429) for a in answers)
        refused = [a.json() for a in answers if a.status_code == 429]
        assert all("max_sandboxes" in r["message"] for r in refused)
    finally:
        for i in made:
            api("DELETE", f"/sandboxes/{i}", key=LIMITED_KEY)


def test_volumes_through_either_gateway():
    """A volume lives on the node that made it; either gateway sends its
    calls there, content calls with the volume's token, and places the
    sandboxes that mount it there."""
    from e2b import Volume
    from e2b.exceptions import NotFoundException

    g1, g2 = GATEWAYS
    name = f"cl-vol-{RUN}"
    vol = Volume.create(name, api_url=g1)
    try:
        vol.write_file("/shared/hello.txt", f"hello {RUN}", api_url=g1)
        assert vol.read_file("/shared/hello.txt", api_url=g2) == f"hello {RUN}"
        assert [e.name for e in vol.list("/shared", api_url=g2)] == ["hello.txt"]
        assert name in [v.name for v in Volume.list(api_url=g2)]
        assert Volume.get_info(name, api_url=g2).token == vol.token
        # A name is the team's across the cluster.
        r = api("POST", "/volumes", gateway=g2, json={"name": name})
        assert r.status_code == 409, r.text
        # Another team does not see it; a wrong token reads nothing.
        assert name not in [v["name"] for v in api("GET", "/volumes", key=OTHER_KEY).json()]
        r = api("GET", f"/volumes/{vol.volume_id}", key=OTHER_KEY)
        assert r.status_code == 404, r.text
        r = httpx.get(f"{g2}/volumecontent/{vol.volume_id}/file", params={"path": "/shared/hello.txt"},
                      headers={"Authorization": "Bearer vt_" + "0" * 40})
        assert r.status_code == 401 and r.json()["code"] == 401, r.text
        # A node takes content calls only from gateways.
        for n in NODES:
            r = httpx.get(f"{n}/volumecontent/{vol.volume_id}/file", params={"path": "/shared/hello.txt"},
                          headers={"Authorization": f"Bearer {vol.token}"})
            assert r.status_code == 401, r.text
        # Sandboxes that mount it run on its node, whichever gateway made
        # them, and share it live; it is not destroyed while they do.
        made = [create(volume_mounts={"/mnt/v": vol}, api_url=g) for g in (g1, g2)]
        try:
            assert node_of(made[0].sandbox_id) == node_of(made[1].sandbox_id)
            for s in made:
                assert s.commands.run("cat /mnt/v/shared/hello.txt").stdout == f"hello {RUN}"
            made[0].commands.run("echo one > /mnt/v/one.txt")
            got = ""
            for _ in range(60):
                got = made[1].commands.run("cat /mnt/v/one.txt 2>/dev/null || true").stdout
                if got == "one\n":
                    break
                time.sleep(0.3)
            assert got == "one\n"
            r = api("DELETE", f"/volumes/{vol.volume_id}", gateway=g2)
            assert r.status_code == 409 and "mounted" in r.text, r.text
        finally:
            for s in made:
                s.kill()
    finally:
        assert Volume.destroy(vol.volume_id, api_url=g2) is True
    assert Volume.destroy(vol.volume_id, api_url=g1) is False
    with pytest.raises(NotFoundException):
        Volume.get_info(vol.volume_id, api_url=g1)


def test_secrets_are_the_clusters_and_every_node_fills_them_in():
    """A secret made through one gateway is read, updated and destroyed
    through the other, and the egress proxy of a sandbox on any node fills
    it into a header (plain HTTP to the stand-in internet by a name its DNS
    answers, see tests/e2e/net/inet.sh: its /headers answers each header's
    SHA-256; a rule with a secret names its host). The
    gateways' key set for workload identity holds every node's keys."""
    from e2b import Secret

    g1, g2 = GATEWAYS
    name, value = f"cl-sec-{RUN}", "sk-" + uuid.uuid4().hex
    sha = lambda v: hashlib.sha256(v.encode()).hexdigest()  # noqa: E731
    info = Secret.create(name, value, api_url=g1)
    made = []
    try:
        assert Secret.get_info(name, api_url=g2).secret_id == info.secret_id
        r = api("GET", f"/secrets/{name}", gateway=g2)
        assert r.status_code == 200 and value not in r.text, r.text
        assert name not in [s["name"] for s in api("GET", "/secrets", key=OTHER_KEY).json()]
        rule = {"api.inet.test": [{"transform": {"headers": {"Authorization": f"Bearer {Secret.fill(name)}"}}}]}
        nodes = set()
        for _ in range(8):
            made.append(create(network={"rules": rule}))
            nodes.add(node_of(made[-1].sandbox_id))
            if len(nodes) >= 2:
                break
        assert len(nodes) >= 2, nodes

        def seen(s):
            out = s.commands.run("curl -sS -m 20 http://api.inet.test/headers", timeout=60).stdout
            return json.loads(out)["authorization"]

        for s in made:
            assert seen(s) == [sha("Bearer " + value)], node_of(s.sandbox_id)
        assert Secret.update(name, value + "-2", api_url=g2).version == 2
        for s in made:
            assert seen(s) == [sha("Bearer " + value + "-2")], node_of(s.sandbox_id)
    finally:
        for s in made:
            s.kill()
        assert Secret.destroy(name, api_url=g2) is True
    assert not Secret.exists(name, api_url=g1)
    # Identity: no key needed, and every node's keys are there.
    gateway_kids = {k["kid"] for k in httpx.get(f"{g2}/.well-known/jwks.json", timeout=30).json()["keys"]}
    for n in NODES:
        for k in httpx.get(f"{n}/.well-known/jwks.json", timeout=30).json()["keys"]:
            assert k["kid"] in gateway_kids, (n, k["kid"])
    r = httpx.get(f"{g1}/.well-known/openid-configuration", timeout=30)
    assert r.status_code == 200 and r.json()["jwks_uri"].endswith("/.well-known/jwks.json"), r.text


def test_a_killed_node_answers_503_creates_go_elsewhere_and_it_comes_back(spread):
    victim = spread[2]
    n = node_of(victim.sandbox_id)
    idx = n.split("-")[1]
    cluster("stop-node", idx)
    try:
        r = httpx.get(GATEWAYS[0] + "/health", headers={"E2b-Sandbox-Id": victim.sandbox_id})
        assert r.status_code == 503 and n in r.json()["message"]
        r = api("POST", f"/sandboxes/{victim.sandbox_id}/timeout", json={"timeout": 500})
        assert r.status_code == 503
        # Creates keep working: a create placed on the dead node (its
        # heartbeat is recent) is sent to another one.
        for _ in range(4):
            s = create()
            try:
                assert node_of(s.sandbox_id) != n
            finally:
                s.kill()
    finally:
        cluster("start-node", idx)
    assert victim.commands.run("echo back").stdout.strip() == "back"


def test_a_node_gone_past_the_grace_is_not_listed_until_it_returns(spread):
    victim = spread[3]
    n = node_of(victim.sandbox_id)
    idx = n.split("-")[1]

    def listed():
        return {x["sandboxID"] for x in api("GET", "/v2/sandboxes", params={"metadata": f"run={RUN}"}).json()}

    cluster("stop-node", idx)
    try:
        time.sleep(12)  # node_grace_secs = 10
        assert victim.sandbox_id not in listed()
    finally:
        cluster("start-node", idx)
    deadline = time.time() + 30
    while victim.sandbox_id not in listed() and time.time() < deadline:
        time.sleep(1)
    assert victim.sandbox_id in listed()


def test_a_killed_gateway_leaves_the_other_serving(spread):
    cluster("stop-gateway", "2")
    try:
        with pytest.raises(httpx.ConnectError):
            httpx.get(GATEWAYS[1] + "/health")
        for s in spread[:3]:
            assert s.commands.run("true").exit_code == 0
        s = create()
        s.kill()
    finally:
        cluster("start-gateway", "2")
    assert httpx.get(GATEWAYS[1] + "/health").status_code == 200


def test_postgres_restarted_known_sandboxes_answer_and_creates_recover(spread):
    s = spread[4]
    s.commands.run("true")  # the gateway knows where it lives
    cluster("stop-postgres")
    try:
        assert s.commands.run("echo still").stdout.strip() == "still"
        r = api("POST", "/v2/sandboxes", json={"templateID": "base"})
        assert r.status_code == 503, r.text
    finally:
        cluster("start-postgres")
    deadline = time.time() + 60
    while True:
        r = api("POST", "/v2/sandboxes", json={"templateID": "base", "metadata": {"run": RUN}})
        if r.status_code == 201 or time.time() > deadline:
            break
        time.sleep(1)
    assert r.status_code == 201, r.text
    api("DELETE", f"/sandboxes/{r.json()['sandboxID']}")


def captures():
    """`tine cluster captures`: the pushed captures' ids and names."""
    p = subprocess.run([os.environ["TINE_BIN"], "cluster", "captures"], capture_output=True, text=True, check=True)
    rows = [line.split() for line in p.stdout.splitlines()[1:] if line.strip()]
    return {r[0]: (r[4].split(",") if len(r) > 4 else []) for r in rows}


def wait_pushed(name):
    """Until a capture with id or name `name` is in the registry."""
    deadline = time.time() + 180
    while not any(name == i or name in names for i, names in captures().items()):
        assert time.time() < deadline, f"{name} was not pushed to the registry"
        time.sleep(1)


def node_url(node_id):
    """The URL of node `node-N`."""
    return NODES[int(node_id.split("-")[1]) - 1]


def fetched_bytes(node):
    """Compressed bytes node `node`'s image daemon fetched since it started."""
    text = httpx.get(node + "/metrics").text
    m = re.search(r'^tine_image_cache_bytes\{kind="fetched"\} (\d+)', text, re.M)
    assert m, text[:2000]
    return int(m.group(1))


def artifact_chunks(capture):
    """The blobs the manifests of capture `capture` name."""
    registry = os.environ["TINE_E2E_REGISTRY"]
    out = []
    for f in ("state", "ram", "disk"):
        r = httpx.get(
            f"http://{registry}/v2/tine/captures/manifests/{capture}.{f}",
            headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
        )
        if r.status_code == 200:
            m = r.json()
            out += [m["config"]["digest"]] + [l["digest"] for l in m["layers"]]
    return out


def blob_exists(digest):
    registry = os.environ["TINE_E2E_REGISTRY"]
    return httpx.head(f"http://{registry}/v2/tine/captures/blobs/{digest}").status_code == 200


def capture_bytes(capture):
    """Compressed bytes of capture `capture`'s distinct chunks in the registry."""
    registry = os.environ["TINE_E2E_REGISTRY"]
    seen = {}
    for f in ("state", "ram", "disk"):
        manifest = httpx.get(
            f"http://{registry}/v2/tine/captures/manifests/{capture}.{f}",
            headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
        ).json()
        seen.update({l["digest"]: l["size"] for l in manifest["layers"]})
    return sum(seen.values())


def test_a_snapshot_restores_on_another_node_through_the_registry(spread):
    src = spread[6]
    src.commands.run(
        "echo travelled > /tmp/travel; head -c 8388608 /dev/urandom > /dev/shm/blob; "
        "md5sum /dev/shm/blob | cut -d' ' -f1 > /tmp/blob.md5; (sleep 100000 &)"
    )
    snap = src.create_snapshot()
    n = node_of(src.sandbox_id)
    wait_pushed(snap.snapshot_id)
    cluster("stop-node", n.split("-")[1])
    made = []
    try:
        # Listed with its only holder down (from the catalog).
        r = api("GET", "/snapshots", params={"sandboxID": src.sandbox_id})
        assert r.status_code == 200 and snap.snapshot_id in [x["snapshotID"] for x in r.json()], r.text
        # Placed on its holder (down: refused before anything was made),
        # then on another node, which pulls it from the registry.
        for g in GATEWAYS:
            r = api("POST", "/v2/sandboxes", gateway=g, json={"templateID": snap.snapshot_id, "timeout": 300})
            assert r.status_code == 201, r.text
            made.append(r.json()["sandboxID"])
            assert node_of(made[-1]) != n
            sb = Sandbox.connect(made[-1])
            assert sb.commands.run("cat /tmp/travel").stdout.strip() == "travelled"
            md5 = sb.commands.run("md5sum /dev/shm/blob | cut -d' ' -f1").stdout.strip()
            assert md5 == sb.commands.run("cat /tmp/blob.md5").stdout.strip()
            assert sb.commands.run("pgrep -x sleep").exit_code == 0
        # Another team cannot pull it.
        r = api("POST", "/v2/sandboxes", key=OTHER_KEY, json={"templateID": snap.snapshot_id})
        assert r.status_code == 404, r.text
    finally:
        for c in made:
            api("DELETE", f"/sandboxes/{c}")
        cluster("start-node", n.split("-")[1])
    # Deleted everywhere (its node and those that pulled it), and no node
    # pulls it again.
    mine = artifact_chunks(snap.snapshot_id)
    time.sleep(2)  # the nodes' heartbeats name what they hold
    r = api("DELETE", f"/templates/{snap.snapshot_id}")
    assert r.status_code == 204, r.text
    assert snap.snapshot_id not in captures()
    r = api("POST", "/v2/sandboxes", json={"templateID": snap.snapshot_id})
    assert r.status_code == 404, r.text
    # Its artifacts leave the registry once no node reads it lazily (the
    # nodes that pulled it let go a minute after their sandboxes ended):
    # its manifests, and its chunks that no other artifact names.
    registry = os.environ["TINE_E2E_REGISTRY"]
    deadline = time.time() + 240
    while artifact_chunks(snap.snapshot_id):
        assert time.time() < deadline, "its manifests stayed in the registry"
        time.sleep(2)
    tags = httpx.get(f"http://{registry}/v2/tine/captures/tags/list?n=100000").json()["tags"] or []
    others = set()
    for c in {t.rsplit(".", 1)[0] for t in tags}:
        others |= set(artifact_chunks(c))
    own = [d for d in mine if d not in others]
    assert own, "the 8 MiB of random memory are chunks of this capture only"
    deadline = time.time() + 30
    while any(blob_exists(d) for d in own):
        assert time.time() < deadline, "its chunks stayed in the registry"
        time.sleep(1)
    assert all(blob_exists(d) for d in set(mine) & others)


def test_a_paused_sandbox_resumes_on_another_node_when_its_own_is_down():
    """Durable pause: the pause capture is pushed; with its node SIGKILLed
    and kept down, `connect` resumes it elsewhere with memory, files,
    processes, network policy, id and token intact. Its node, back, drops
    its copy; the sandbox stays where it went."""
    sb = create(allow_internet_access=False)
    sid = sb.sandbox_id
    try:
        sb.commands.run(
            "echo kept > /tmp/kept; head -c 8388608 /dev/urandom > /dev/shm/blob; "
            "md5sum /dev/shm/blob | cut -d' ' -f1 > /tmp/blob.md5; (sleep 100000 &)"
        )
        before = api("GET", f"/sandboxes/{sid}").json()
        token = api("POST", f"/sandboxes/{sid}/connect", json={"timeout": 600}).json()["envdAccessToken"]
        n = before["nodeID"]
        assert sb.pause() is True
        wait_pushed_pause(sid)
        cluster("stop-node", n.split("-")[1])
        try:
            r = api("POST", f"/sandboxes/{sid}/connect", gateway=GATEWAYS[1], json={"timeout": 600})
            assert r.status_code == 201, r.text
            assert r.json()["sandboxID"] == sid and r.json()["envdAccessToken"] == token
            after = api("GET", f"/sandboxes/{sid}").json()
            assert after["nodeID"] != n and after["state"] == "running"
            assert after["network"] == before["network"], (before, after)
            assert after["metadata"] == before["metadata"]
            again = Sandbox.connect(sid)
            assert again.commands.run("cat /tmp/kept").stdout.strip() == "kept"
            md5 = again.commands.run("md5sum /dev/shm/blob | cut -d' ' -f1").stdout.strip()
            assert md5 == again.commands.run("cat /tmp/blob.md5").stdout.strip()
            assert again.commands.run("pgrep -x sleep").exit_code == 0
        finally:
            cluster("start-node", n.split("-")[1])
        # Back up, its old node drops its copy at its first list; the
        # sandbox stays on the node that resumed it, and pauses and
        # resumes there as any.
        old = os.path.join(os.environ["TINE_CLUSTER_DIR"], f"node-{n.split('-')[1]}", "snapshots")
        deadline = time.time() + 30
        while any(d.startswith(f"p-{sid}-") for d in os.listdir(old)):
            assert time.time() < deadline, "the old node kept the moved sandbox's capture"
            time.sleep(1)
        where = node_of(sid)
        assert where == after["nodeID"]
        assert again.pause() is True
        r = api("POST", f"/sandboxes/{sid}/connect", json={"timeout": 600})
        assert r.status_code == 201, r.text
        assert node_of(sid) == where
        assert again.commands.run("cat /tmp/kept").stdout.strip() == "kept"
    finally:
        api("DELETE", f"/sandboxes/{sid}")


def wait_pushed_pause(sandbox_id):
    """Until the pause capture of `sandbox_id` is in the registry."""
    deadline = time.time() + 180
    while not any(i.startswith(f"p-{sandbox_id}-") for i in captures()):
        assert time.time() < deadline, f"the pause of {sandbox_id} was not pushed"
        time.sleep(1)


def restart_node(idx, extra_config="", lazy=True):
    """SIGTERM node `idx` and start it again (its VMs live on and are
    adopted), with `extra_config` added to its config, reading pulled
    captures lazily or not."""
    cluster("term-node", idx)
    env = dict(os.environ)
    env["TINE_CLUSTER_NODE_CONFIG"] = os.environ.get("TINE_CLUSTER_NODE_CONFIG", "") + "\n" + extra_config
    env["TINE_CLUSTER_LAZY_PULL"] = "true" if lazy else "false"
    subprocess.run(["bash", CLUSTER, "start-node", idx], check=True, timeout=300, env=env)


def test_a_fork_larger_than_its_nodes_room_starts_the_rest_on_other_nodes(spread):
    src = spread[8]
    n = node_of(src.sandbox_id)
    idx = n.split("-")[1]
    src.commands.run(
        "echo forked > /tmp/f; head -c 4194304 /dev/urandom > /dev/shm/blob; "
        "md5sum /dev/shm/blob | cut -d' ' -f1 > /tmp/blob.md5"
    )
    # Its node admits at most 12 sandboxes: fewer than 16 children fit.
    restart_node(idx, "max_sandboxes = 12")
    children = []
    try:
        time.sleep(2)  # a heartbeat with its new capacity
        r = api("POST", f"/sandboxes/{src.sandbox_id}/fork", json={"count": 16, "timeout": 300})
        assert r.status_code == 201, r.text
        entries = r.json()
        assert len(entries) == 16, entries
        assert all("sandbox" in e for e in entries), [e for e in entries if "sandbox" not in e]
        children = [e["sandbox"]["sandboxID"] for e in entries]
        assert len(set(children)) == 16
        where = {c: node_of(c) for c in children}
        assert n in where.values() and len(set(where.values())) >= 2, where
        seeds = set()
        for c in children:
            sb = Sandbox.connect(c)
            out = sb.commands.run(
                "cat /tmp/f; md5sum /dev/shm/blob | cut -d' ' -f1; cat /tmp/blob.md5; "
                "python3 -c 'import os; print(os.urandom(16).hex())'"
            ).stdout.split()
            assert out[0] == "forked" and out[1] == out[2], (c, where[c], out)
            seeds.add(out[3])
        assert len(seeds) == 16, "children share their random state"
        assert src.commands.run("cat /tmp/f").stdout.strip() == "forked"
        # The capture went to the registry for the children only.
        assert not any(i.startswith("f-") for i in captures())
    finally:
        for c in children:
            api("DELETE", f"/sandboxes/{c}")
        restart_node(idx)


def test_a_chunk_damaged_in_the_registry_is_a_clear_error_not_a_sandbox(spread):
    src = spread[7]
    src.commands.run("head -c 4194304 /dev/urandom > /dev/shm/only-here")
    snap = src.create_snapshot()
    n = node_of(src.sandbox_id)
    wait_pushed(snap.snapshot_id)
    registry = os.environ["TINE_E2E_REGISTRY"]
    manifest = httpx.get(
        f"http://{registry}/v2/tine/captures/manifests/{snap.snapshot_id}.ram",
        headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
    ).json()
    # The chunk of the RAM that holds the most data: one no other capture has.
    digest = max(manifest["layers"], key=lambda l: l["size"])["digest"]
    h = digest.split(":")[1]
    blob = os.path.join(os.environ["TINE_CLUSTER_DIR"], "registry", "data", "docker", "registry", "v2", "blobs", "sha256", h[:2], h, "data")
    with open(blob, "r+b") as f:
        f.seek(100)
        f.write(b"\0damaged\0")
    others = [str(i) for i in range(1, len(NODES) + 1) if str(i) != n.split("-")[1]]
    cluster("stop-node", n.split("-")[1])
    try:
        # Read lazily: the sandbox starts (the damaged chunk is not read
        # yet); the first read of it ends its VM, never with wrong bytes,
        # and the sandbox's end names the capture and the chunk.
        r = api("POST", "/v2/sandboxes", json={"templateID": snap.snapshot_id, "metadata": {"run": RUN}})
        assert r.status_code == 201, r.text
        sid = r.json()["sandboxID"]
        host = node_of(sid)
        sb = Sandbox.connect(sid)
        with pytest.raises(Exception):
            out = sb.commands.run("md5sum /dev/shm/only-here", timeout=60)
            pytest.fail(f"read the damaged memory: {out.stdout}")
        deadline = time.time() + 60
        while api("GET", f"/sandboxes/{sid}").status_code != 404:
            assert time.time() < deadline, "the sandbox outlived its VM"
            time.sleep(1)
        log = open(os.path.join(os.environ["TINE_CLUSTER_DIR"], host, "server.log")).read()
        ended = [l for l in log.splitlines() if sid in l and "exited unexpectedly" in l]
        assert ended and snap.snapshot_id in ended[-1] and "damaged" in ended[-1] and "ram" in ended[-1], ended
        # Fetched whole first (lazy pulls off): the create fails with the
        # same names, and no sandbox is made.
        for i in others:
            restart_node(i, lazy=False)
        r = api("POST", "/v2/sandboxes", json={"templateID": snap.snapshot_id, "metadata": {"run": RUN}})
        assert r.status_code == 502, r.text
        msg = r.json()["message"]
        assert snap.snapshot_id in msg and "damaged" in msg and "ram" in msg, msg
        listed = api("GET", "/v2/sandboxes", params={"metadata": f"run={RUN}"}).json()
        assert all(x["templateID"] != snap.snapshot_id for x in listed)
    finally:
        for i in others:
            restart_node(i)
        cluster("start-node", n.split("-")[1])


def test_a_template_built_on_one_node_starts_on_the_others_through_the_registry():
    name = f"cl-tpl-{RUN}"
    Template.build(
        Template().from_template("base").run_cmd("echo built once > /tmp/built"),
        f"{name}:v1",
        cpu_count=1,
        memory_mb=256,
    )
    first = create(template=name)
    builder = node_of(first.sandbox_id)
    first.kill()
    wait_pushed(f"{name}:v1")
    capture = next(i for i, names in captures().items() if f"{name}:v1" in names)
    stored = capture_bytes(capture)
    cluster("stop-node", builder.split("-")[1])
    made = []
    try:
        before = {n: fetched_bytes(n) for n in NODES if n != node_url(builder)}
        for template in (name, f"{name}:v1"):
            s = create(template=template)
            made.append(s)
            assert node_of(s.sandbox_id) != builder
            assert s.commands.run("cat /tmp/built").stdout.strip() == "built once"
        # Its RAM and disk are read lazily: a node that started it fetched
        # only the chunks its sandbox touched.
        for n in {node_url(node_of(s.sandbox_id)) for s in made}:
            got = fetched_bytes(n) - before[n]
            assert 0 < got < stored / 2, (n, got, stored)
        # Another team does not get it.
        r = api("POST", "/v2/sandboxes", key=OTHER_KEY, json={"templateID": name})
        assert r.status_code == 404, r.text
    finally:
        for s in made:
            s.kill()
        cluster("start-node", builder.split("-")[1])


def push_base_image(repo, tag, env):
    """The base rootfs (the tar its ext4 was made from) as a one-layer
    image in the cluster's registry; its reference."""
    registry = os.environ["TINE_E2E_REGISTRY"]
    data = os.environ.get("TINE_DATA_DIR", "/var/lib/tine")
    base = os.path.realpath(os.path.join(data, "current", "rootfs-base.ext4"))

    def blob(body):
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        r = httpx.post(f"http://{registry}/v2/{repo}/blobs/uploads/")
        assert r.status_code == 202, r.text
        loc = r.headers["Location"]
        loc = loc if loc.startswith("http") else f"http://{registry}{loc}"
        sep = "&" if "?" in loc else "?"
        r = httpx.put(f"{loc}{sep}digest={digest}", content=body,
                      headers={"Content-Type": "application/octet-stream"}, timeout=300)
        assert r.status_code == 201, r.text
        return {"digest": digest, "size": len(body)}

    with open(base[: -len(".ext4")] + ".tar", "rb") as f:
        layer = blob(f.read())
    config = json.dumps({"architecture": "amd64", "os": "linux",
                         "config": {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", env]},
                         "rootfs": {"type": "layers", "diff_ids": []}}).encode()
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **blob(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", **layer}],
    }
    r = httpx.put(f"http://{registry}/v2/{repo}/manifests/{tag}", content=json.dumps(manifest).encode(),
                  headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"})
    assert r.status_code == 201, r.text
    return f"{registry}/{repo}:{tag}"


def test_a_template_on_an_oci_image_and_a_snapshot_of_it_start_on_other_nodes():
    """The image's chunks travel with the template's capture: a node that
    never pulled the image starts the template with its builder down, and a
    snapshot of that sandbox (its disk flattened onto the image) restores
    on a third node with the first two down."""
    # Its own digest each run: nodes keep their image stores between runs.
    image = push_base_image("e2e/cl-image", RUN, f"TINE_IMG=cluster-{RUN}")
    name = f"cl-img-{RUN}"
    Template.build(
        Template().from_image(image).run_cmd("echo on the image > /tmp/img"),
        f"{name}:v1",
        cpu_count=1,
        memory_mb=256,
    )
    first = create(template=name)
    builder = node_of(first.sandbox_id)
    first.kill()
    wait_pushed(f"{name}:v1")
    down = [builder]
    cluster("stop-node", builder.split("-")[1])
    made = []
    try:
        s = create(template=name)
        made.append(s)
        second = node_of(s.sandbox_id)
        assert second != builder
        run = lambda cmd: s.commands.run(cmd).stdout.strip()
        assert run("cat /tmp/img") == "on the image"
        assert run("echo $TINE_IMG") == f"cluster-{RUN}"
        # Files of the image itself, read through this node's image daemon.
        assert "Debian" in run("cat /etc/os-release")
        assert run("md5sum /usr/bin/env | cut -d' ' -f1") == run("md5sum /bin/env | cut -d' ' -f1")
        run("echo snapped > /home/user/snap.txt && (sleep 100000 &)")
        snap = s.create_snapshot()
        wait_pushed(snap.snapshot_id)
        down.append(second)
        cluster("stop-node", second.split("-")[1])
        r = api("POST", "/v2/sandboxes", json={"templateID": snap.snapshot_id, "timeout": 300})
        assert r.status_code == 201, r.text
        third = Sandbox.connect(r.json()["sandboxID"])
        made.append(third)
        assert node_of(third.sandbox_id) not in down
        assert third.commands.run("cat /home/user/snap.txt /tmp/img").stdout.split() == ["snapped", "on", "the", "image"]
        assert third.commands.run("pgrep -x sleep").exit_code == 0
        assert "Debian" in third.commands.run("cat /etc/os-release").stdout
    finally:
        for n in down:
            cluster("start-node", n.split("-")[1])
        for s in made:
            try:
                s.kill()
            except Exception:
                pass
