"""`network.egress_proxy` (issue 33) through the real SDK: a sandbox's
outbound TCP tunnelled through a SOCKS5 proxy, with and without
credentials, after the policy's filtering, failing closed.

The proxy is tests/e2e/net/socks5.py, started by the test inside the
stand-in internet's namespace (tests/e2e/net/inet.sh) on 203.0.113.20; it
logs every CONNECT it serves. The destinations are the stand-in's HTTP
(80), HTTPS (443) and a port whose server speaks first (2222).
"""

import os
import subprocess
import uuid

import pytest
from e2b import ALL_TRAFFIC

from conftest import assert_error, http

INET = "203.0.113.10"
PROXY_ADDR = "203.0.113.20"
SOCKS = os.path.join(os.path.dirname(__file__), "..", "..", "net", "socks5.py")
INET_STATE = "/run/tine-e2e-inet"  # the stand-in's test CA and certificate


def run(s, cmd):
    """(exit code, stdout) of `cmd` in the sandbox."""
    r = s.commands.run(f"{cmd}; echo \"rc=$?\"", timeout=60)
    out, _, rc = r.stdout.rpartition("rc=")
    return int(rc.strip()), out


@pytest.fixture
def socks():
    """start(port, user=None, password=None) -> (its CONNECT log, its process)."""
    procs = []

    def start(port, user=None, password=None, tls=False):
        log = f"/run/tine-e2e-inet/socks-{port}-{uuid.uuid4().hex[:6]}.log"
        cmd = ["ip", "netns", "exec", "e2e-inet", "python3", SOCKS, "--listen", f"{PROXY_ADDR}:{port}", "--log", log]
        if user:
            cmd += ["--user", user, "--password", password]
        if tls:
            cmd += ["--tls-cert", f"{INET_STATE}/cert.pem", "--tls-key", f"{INET_STATE}/key.pem"]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(p)
        assert p.stdout.readline().strip() == "ready", "the SOCKS5 proxy did not start"
        open(log, "a").close()
        return log, p

    yield start
    for p in procs:
        p.kill()
        p.wait()


def lines(log):
    with open(log) as f:
        return f.read().split("\n")


def test_tcp_goes_through_the_proxy_after_the_policy_and_fails_closed(fresh, socks):
    log, proxy = socks(1080)
    s = fresh(network={"egress_proxy": {"address": f"{PROXY_ADDR}:1080"}, "deny_out": ["203.0.113.20/32"]})
    code, body = run(s, f"curl -sS -m 10 http://{INET}/")
    assert code == 0 and body.startswith(f"inet {INET} "), body
    assert f"CONNECT {INET}:80" in lines(log)
    code, _ = run(s, f"curl -sSk -m 10 -o /dev/null https://{INET}/")
    assert code == 0 and f"CONNECT {INET}:443" in lines(log)
    # A server that speaks first: nothing to sniff, still tunnelled.
    code, body = run(s, f"python3 -c \"import socket; print(socket.create_connection(('{INET}', 2222), 5).recv(64).decode().strip())\"")
    assert code == 0 and body.strip() == f"banner {INET}", body
    assert f"CONNECT {INET}:2222" in lines(log)
    # Filtering comes first: a denied address never reaches the proxy.
    before = len(lines(log))
    code, body = run(s, "curl -sS -m 5 http://203.0.113.20/")
    assert "blocked by the sandbox's network policy" in body, body
    assert len(lines(log)) == before
    # Shown without what was not asked back (no password here anyway).
    status, _, raw = http("GET", f"/sandboxes/{s.sandbox_id}")
    assert b'"egressProxy":{"address":"203.0.113.20:1080"}' in raw.replace(b" ", b""), raw
    # No proxy, no connection: it fails closed.
    proxy.kill()
    proxy.wait()
    code, _ = run(s, f"curl -sS -m 5 http://{INET}/")
    assert code != 0


def test_credentials_and_update_network_on_a_running_sandbox(fresh, socks):
    password = "pw-" + uuid.uuid4().hex[:8]
    log, _ = socks(1081, "rl-user", password)
    s = fresh()
    code, body = run(s, f"curl -sS -m 10 http://{INET}/")
    assert code == 0 and f"CONNECT {INET}:80" not in lines(log), "direct before"
    s.update_network({"egress_proxy": {"address": f"{PROXY_ADDR}:1081", "username": "rl-user", "password": "wrong"}})
    code, _ = run(s, f"curl -sS -m 5 http://{INET}/")
    assert code != 0 and "AUTH-FAILED rl-user" in lines(log)
    s.update_network({"egress_proxy": {"address": f"{PROXY_ADDR}:1081", "username": "rl-user", "password": password}})
    code, body = run(s, f"curl -sS -m 10 http://{INET}/")
    assert code == 0 and body.startswith(f"inet {INET} ") and f"CONNECT {INET}:80" in lines(log)
    status, _, raw = http("GET", f"/sandboxes/{s.sandbox_id}")
    assert b"rl-user" in raw and password.encode() not in raw, "the password is never shown"
    # An update without it goes direct again.
    s.update_network({"deny_out": [ALL_TRAFFIC], "allow_out": [INET]})
    before = len(lines(log))
    code, _ = run(s, f"curl -sS -m 10 http://{INET}/")
    assert code == 0 and len(lines(log)) == before


def test_tls_to_the_proxy_is_verified_and_never_falls_back(fresh, socks):
    log, _ = socks(1082, tls=True)
    ca = open(f"{INET_STATE}/ca.pem").read()
    # The proxy's certificate (from the stand-in's test CA) names its address.
    s = fresh(network={"egress_proxy": {"address": f"{PROXY_ADDR}:1082", "tls": {"ca_cert": ca}}})
    code, body = run(s, f"curl -sS -m 10 http://{INET}/")
    assert code == 0 and body.startswith(f"inet {INET} "), body
    assert f"CONNECT {INET}:80" in lines(log)
    # Another CA (the server's own egress CA did not sign the proxy's
    # certificate): refused, and not sent in clear instead.
    other_ca = open(os.path.join(os.environ["TINE_DATA_DIR"], "egress-ca", "ca.crt")).read()
    s.update_network({"egress_proxy": {"address": f"{PROXY_ADDR}:1082", "tls": {"ca_cert": other_ca}}})
    before = len(lines(log))
    code, _ = run(s, f"curl -sS -m 5 http://{INET}/")
    assert code != 0 and len(lines(log)) == before
    # A name the certificate does not carry: refused too.
    s.update_network(
        {"egress_proxy": {"address": f"{PROXY_ADDR}:1082", "tls": {"ca_cert": ca, "server_name": "proxy.elsewhere.test"}}}
    )
    code, _ = run(s, f"curl -sS -m 5 http://{INET}/")
    assert code != 0 and len(lines(log)) == before
    # `tls: True` trusts the host's store and `[network] upstream_ca_file`
    # (which holds the stand-in's CA here).
    s.update_network({"egress_proxy": {"address": f"{PROXY_ADDR}:1082", "tls": True}})
    code, body = run(s, f"curl -sS -m 10 http://{INET}/")
    assert code == 0 and body.startswith(f"inet {INET} "), body


@pytest.mark.parametrize(
    "proxy, needle",
    [
        ({"address": "203.0.113.20"}, "host:port"),
        ({"address": "10.99.0.10:1080"}, "not on the internet"),
        ({"address": "203.0.113.20:1080", "password": "x"}, "needs a username"),
        ({"address": "203.0.113.20:1080", "tls": {"enabled": True, "caCert": "junk"}}, "PEM"),
    ],
)
def test_bad_proxies_are_refused_before_the_sandbox_exists(proxy, needle):
    doc = assert_error(http("POST", "/sandboxes", {"templateID": "base", "network": {"egressProxy": proxy}}), 400)
    assert needle in doc["message"], doc
