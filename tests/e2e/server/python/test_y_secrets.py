"""Secrets (issue 33) through the real SDK: E2B's Secret API, and header
transforms in `network.rules` whose `${e2b.secrets.<name>}` placeholders
the sandbox's egress proxy resolves on the wire, over HTTPS (terminated
with the host's egress CA, which the guest trusts) and plain HTTP.

The destination is the stand-in internet (tests/e2e/net/inet.sh): every
name resolves to 203.0.113.10, whose `/headers` answers the SHA-256 of
each header it received, so the test sees what arrived while the sandbox
never sees a secret's value. The server trusts the stand-in's test CA
through `[network] upstream_ca_file` (../run.sh).
"""

import hashlib
import json
import os
import sqlite3
import time
import uuid

import pytest
from e2b import Secret, SecretException, SecretNotFoundException

from conftest import assert_error, http, new_sandbox

HOST = "api.inet.test"
SEEN = "/run/tine-e2e-inet/seen.jsonl"  # what the stand-in received, in full
TOKEN_TTL = 8  # [identity] token_ttl_secs in ../run.sh
OTHER = "other.inet.test"
DATA = os.environ["TINE_DATA_DIR"]


def sha(v):
    return hashlib.sha256(v.encode()).hexdigest()


def uniq(prefix="sec"):
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def headers_seen(s, url, extra=""):
    """What the stand-in received from the sandbox: header -> [sha256]."""
    r = s.commands.run(f"curl -sS -m 20 {extra} {url}", timeout=60)
    return json.loads(r.stdout)


def transform(name, header="Authorization", template="Bearer {}"):
    return {"transform": {"headers": {header: template.format(Secret.fill(name))}}}


# Searches the guest for a value without ever sending it there: the
# pattern arrives XOR-ed with a key, and only this script's own memory
# holds it in clear. The agent (pid 1) is searched, every process's
# environment, and the files of the usual writable places.
FINDER = r"""
import os, sys
key = bytes.fromhex(sys.argv[1])
pat = bytes(b ^ key[i % len(key)] for i, b in enumerate(bytes.fromhex(sys.argv[2])))
me = str(os.getpid())
hits = []
with open("/proc/1/maps") as maps, open("/proc/1/mem", "rb", 0) as mem:
    for line in maps:
        parts = line.split()
        if "r" not in parts[1]:
            continue
        a, b = (int(x, 16) for x in parts[0].split("-"))
        try:
            mem.seek(a)
            if pat in mem.read(b - a):
                hits.append("agent memory " + parts[0])
        except (OSError, OverflowError, ValueError):
            pass
for pid in os.listdir("/proc"):
    if pid.isdigit() and pid != me:
        try:
            if pat in open(f"/proc/{pid}/environ", "rb").read():
                hits.append("environ of " + pid)
        except OSError:
            pass
for top in ("/etc", "/root", "/home", "/tmp", "/var", "/usr/local", "/opt", "/run"):
    for d, _, files in os.walk(top):
        for f in files:
            p = os.path.join(d, f)
            try:
                if os.path.isfile(p) and os.path.getsize(p) < 64 << 20 and pat in open(p, "rb").read():
                    hits.append(p)
            except OSError:
                pass
print("HITS " + ";".join(hits) if hits else "CLEAN")
"""


def assert_nowhere_in_guest(s, value):
    key = os.urandom(16)
    hidden = bytes(b ^ key[i % 16] for i, b in enumerate(value.encode()))
    s.files.write("/tmp/tine-finder.py", FINDER)
    r = s.commands.run(
        f"python3 /tmp/tine-finder.py {key.hex()} {hidden.hex()}", user="root", timeout=300
    )
    assert r.stdout.strip() == "CLEAN", r.stdout


def test_secret_api_is_write_only_paged_and_team_scoped(other_key):
    name = uniq()
    info = Secret.create(name, "first-value", metadata={"owner": "rl"})
    assert (info.name, info.version, info.metadata) == (name, 1, {"owner": "rl"})
    assert info.secret_id and info.created_at and info.updated_at
    assert Secret.exists(name) and Secret.exists(info.secret_id)
    assert Secret.get_info(name).secret_id == info.secret_id
    status, _, body = http("GET", f"/secrets/{info.secret_id}")
    assert status == 200 and b"first-value" not in body
    assert set(json.loads(body)) == {"secretID", "name", "currentVersion", "metadata", "createdAt", "updatedAt"}
    up = Secret.update(name, "second-value")
    assert (up.version, up.metadata) == (2, {"owner": "rl"}), "metadata kept when not given"
    up = Secret.update(info.secret_id, "third-value", metadata={})
    assert (up.version, up.metadata) == (3, {})
    with pytest.raises(SecretException):
        Secret.create(name, "again")
    # Pages of one, oldest first, until every secret was seen.
    more = [Secret.create(uniq(), "v").name for _ in range(2)]
    pager, seen = Secret.list(limit=1), []
    while pager.has_next:
        page = pager.next_items()
        assert len(page) <= 1
        seen += [p.name for p in page]
    assert {name, *more} <= set(seen) and len(seen) == len(set(seen))
    status, _, body = http("GET", "/secrets")
    assert status == 200 and b"-value" not in body
    # Another team sees none of it.
    assert not Secret.exists(name, api_key=other_key)
    with pytest.raises(SecretNotFoundException):
        Secret.get_info(name, api_key=other_key)
    with pytest.raises(SecretNotFoundException):
        Secret.update(name, "x", api_key=other_key)
    assert Secret.destroy(name, api_key=other_key) is False
    assert Secret.destroy(name) is True
    assert Secret.destroy(name) is False
    assert not Secret.exists(name)
    for n in more:
        Secret.destroy(n)
    # At rest the value is sealed: not in the database in clear.
    for f in ("tine.db", "tine.db-wal"):
        p = os.path.join(DATA, f)
        if os.path.exists(p):
            assert b"third-value" not in open(p, "rb").read()


def test_a_transform_sets_the_header_over_https_and_http_and_the_guest_never_sees_it(fresh):
    name, value = uniq(), "sk-" + uuid.uuid4().hex
    Secret.create(name, value)
    try:
        s = fresh(network={"rules": {HOST: [transform(name), {"transform": {"headers": {"X-Fixed": "plain"}}}]}})
        for scheme in ("https", "http"):
            seen = headers_seen(
                s, f"{scheme}://{HOST}/headers", "-H 'Authorization: from-the-guest' -v 2>>/tmp/curl-trace.log"
            )
            assert seen["authorization"] == [sha("Bearer " + value)], scheme
            assert seen["x-fixed"] == [sha("plain")]
        # The guest's own TLS stacks trust the proxy's certificate: Python
        # (SSL_CERT_FILE from /init) without any flag.
        r = s.commands.run(
            f"python3 -c \"import urllib.request as u; print(u.urlopen('https://{HOST}/headers', timeout=20).read().decode())\"",
            timeout=60,
        )
        assert json.loads(r.stdout)["authorization"] == [sha("Bearer " + value)]
        # Where a request goes is the connection's: another Host, an
        # absolute URI naming another host, or TRACE (which echoes headers)
        # are refused; plain HTTP dialled to another address with the
        # rule's Host goes where the sandboxes' resolver says, not there.
        for extra, status in [
            (f"-H 'Host: {OTHER}' https://{HOST}/headers", "421"),
            (f"--request-target http://{OTHER}/headers https://{HOST}/headers", "421"),
            (f"-X TRACE https://{HOST}/", "405"),
        ]:
            r = s.commands.run(f"curl -sS -m 20 -o /dev/null -w '%{{http_code}}' {extra}", timeout=60)
            assert r.stdout == status, (extra, r.stdout)
        r = s.commands.run(f"curl -sS -m 20 -H 'Host: {HOST}' http://203.0.113.20/", timeout=60)
        assert r.stdout == f"inet 203.0.113.10 host={HOST}\n", r.stdout
        # A host without a rule is spliced as before: its own certificate
        # (the guest does not trust the stand-in's CA), nothing added.
        seen = headers_seen(s, f"https://{OTHER}/headers", "-k -H 'Authorization: from-the-guest'")
        assert seen["authorization"] == [sha("from-the-guest")]
        assert "x-fixed" not in seen
        # A new value applies at the next request.
        Secret.update(name, value + "-rotated")
        seen = headers_seen(s, f"https://{HOST}/headers")
        assert seen["authorization"] == [sha("Bearer " + value + "-rotated")]
        # The rules read back as given (placeholders, never values).
        status, _, body = http("GET", f"/sandboxes/{s.sandbox_id}")
        doc = json.loads(body)
        assert Secret.fill(name) in json.dumps(doc["network"]["rules"]), doc.get("network")
        assert value.encode() not in body
        assert_nowhere_in_guest(s, value)
        assert_nowhere_in_guest(s, value + "-rotated")
    finally:
        Secret.destroy(name)


def test_update_network_adds_and_removes_a_rule_on_a_running_sandbox(fresh):
    name, value = uniq(), "tok-" + uuid.uuid4().hex
    Secret.create(name, value)
    try:
        s = fresh()
        assert "authorization" not in headers_seen(s, f"http://{HOST}/headers")
        s.update_network({"rules": {HOST: [transform(name, "X-Api-Key", "{}")]}})
        assert headers_seen(s, f"https://{HOST}/headers")["x-api-key"] == [sha(value)]
        assert headers_seen(s, f"http://{HOST}/headers")["x-api-key"] == [sha(value)]
        s.update_network({})
        assert "x-api-key" not in headers_seen(s, f"http://{HOST}/headers")
        # Spliced again: the stand-in's own certificate.
        assert "x-api-key" not in headers_seen(s, f"https://{HOST}/headers", "-k")
    finally:
        Secret.destroy(name)


def test_an_unknown_secret_refuses_the_request_and_records_why(fresh):
    missing = uniq("missing")
    s = fresh(network={"rules": {HOST: [transform(missing)]}})
    r = s.commands.run(
        f"curl -sS -m 20 -w '\\n%{{http_code}}' https://{HOST}/headers", timeout=60
    )
    body, _, code = r.stdout.rpartition("\n")
    assert code == "502", r.stdout
    assert missing in body and "does not exist" in body, body
    assert "${e2b" not in body
    db = sqlite3.connect(f"file:{os.path.join(DATA, 'tine.db')}?mode=ro", uri=True)
    try:
        rows = db.execute(
            "SELECT detail FROM events WHERE sandbox_id = ? AND kind = 'egress_refused'",
            (s.sandbox_id,),
        ).fetchall()
    finally:
        db.close()
    assert any(missing in d for (d,) in rows), rows


def arrived(mark):
    """The headers of the stand-in's request whose path carries `mark`."""
    with open(SEEN) as f:
        for line in f:
            doc = json.loads(line)
            if mark in doc["path"]:
                return {k.lower(): v for k, v in doc["headers"].items()}
    raise AssertionError(f"no request with {mark} reached the stand-in")


def test_workload_identity_tokens_verify_with_the_published_keys_and_expire(fresh):
    import jwt  # PyJWT: the relying party

    aud = f"https://relying.test/{uuid.uuid4().hex[:8]}"
    s = fresh(
        iam={"tokens": {"svc": Secret.iam_token(audience=aud, token_type="JWT-SVID")}},
        network={
            "rules": {
                HOST: [
                    {"transform": lambda ctx: {"headers": {"Authorization": f"Bearer {ctx.iam.tokens['svc']}"}}}
                ]
            }
        },
    )
    mark = uuid.uuid4().hex
    seen = headers_seen(s, f"https://{HOST}/headers?m={mark}")
    token = arrived(mark)["authorization"].removeprefix("Bearer ")
    assert seen["authorization"] == [sha("Bearer " + token)]
    # Discovery and keys are public: no API key.
    status, _, body = http("GET", "/.well-known/openid-configuration", key=None)
    assert status == 200, body
    doc = json.loads(body)
    status, _, body = http("GET", "/" + doc["jwks_uri"].split("/", 3)[3], key=None)
    assert status == 200, body
    jwks = jwt.PyJWKSet.from_dict(json.loads(body))
    kid = jwt.get_unverified_header(token)["kid"]
    key = next(k for k in jwks.keys if k.key_id == kid)
    claims = jwt.decode(token, key.key, algorithms=["ES256"], audience=aud, issuer=doc["issuer"])
    assert claims["sub"].endswith(f"/sandbox/{s.sandbox_id}"), claims
    assert claims["sub"].startswith("spiffe://")
    assert claims["exp"] - claims["iat"] == TOKEN_TTL
    with pytest.raises(jwt.InvalidAudienceError):
        jwt.decode(token, key.key, algorithms=["ES256"], audience="https://someone-else.test")
    # A second request gets a fresh token.
    mark2 = uuid.uuid4().hex
    headers_seen(s, f"http://{HOST}/headers?m={mark2}")
    assert arrived(mark2)["authorization"] != "Bearer " + token
    assert_nowhere_in_guest(s, token)
    # Expired: refused by the same relying party.
    time.sleep(max(0, claims["exp"] - time.time()) + 1)
    with pytest.raises(jwt.ExpiredSignatureError):
        jwt.decode(token, key.key, algorithms=["ES256"], audience=aud, leeway=0)


def test_tokens_must_be_registered_and_of_a_known_type(fresh):
    rule = {HOST: [{"transform": {"headers": {"Authorization": "Bearer ${e2b.identity.tokens.svc}"}}}]}
    doc = assert_error(http("POST", "/sandboxes", {"templateID": "base", "network": {"rules": rule}}), 400)
    assert "does not register" in doc["message"], doc
    doc = assert_error(
        http(
            "POST",
            "/sandboxes",
            {"templateID": "base", "iam": {"tokens": {"svc": {"audience": "a", "tokenType": "X509-SVID"}}}},
        ),
        400,
    )
    assert "JWT-SVID" in doc["message"], doc
    s = fresh()
    doc = assert_error(
        http("PUT", f"/sandboxes/{s.sandbox_id}/network", {"rules": rule}), 400
    )
    assert "does not register" in doc["message"], doc


@pytest.mark.parametrize(
    "network, needle",
    [
        ({"rules": {"not a domain!": [{"transform": {"headers": {"X": "y"}}}]}}, "not a domain"),
        ({"rules": {HOST: [{"transform": {"headers": {"X-${e2b.secrets.a}": "y"}}}]}}, "values only"),
        ({"rules": {HOST: [{"transform": {"headers": {"X": "${e2b.secret.a}"}}}]}}, "unknown placeholder"),
        ({"rules": {HOST: [{"transform": {"headers": {"Host": "${e2b.secrets.a}"}}}]}}, "cannot set"),
        ({"rules": {HOST: [{"transform": {"headers": {"X": "${e2b.identity.tokens.}"}}}]}}, "does not name a token"),
    ],
)
def test_bad_rules_are_refused_clearly(network, needle):
    doc = assert_error(http("POST", "/sandboxes", {"templateID": "base", "network": network}), 400)
    assert needle in doc["message"], doc


def test_bad_secrets_and_misplaced_placeholders_are_refused():
    for body, needle in [
        ({"name": "a{b", "value": "v"}, "invalid secret name"),
        ({"name": "", "value": "v"}, "invalid secret name"),
        ({"name": uniq(), "value": "a\r\nX-Evil: 1"}, "control characters"),
        ({"name": uniq(), "value": "v", "extra": 1}, "unknown field"),
        ({"name": uniq()}, "value"),
    ]:
        doc = assert_error(http("POST", "/secrets", body), 400)
        assert needle in doc["message"], (body, doc)
    assert_error(http("POST", "/secrets", b"{not json", {"Content-Type": "application/json"}), 400)
    assert_error(http("GET", "/secrets/sec_nope"), 404)
    assert_error(http("POST", "/secrets/sec_nope", {"value": "v"}), 404)
    assert_error(http("GET", "/secrets?limit=0"), 400)
    assert_error(http("GET", "/secrets?nextToken=%%%"), 400)
    assert_error(http("GET", "/secrets", key="e2b_wrong"), 401)
    doc = assert_error(
        http("POST", "/sandboxes", {"templateID": "base", "envVars": {"K": "${e2b.secrets.x}"}}), 400
    )
    assert "envVars" in doc["message"]
    with pytest.raises(Exception):
        new_sandbox(envs={"K": Secret.fill("x")})
