"""Sandbox networking through the real SDK (issue "Sandbox networking"):
egress to a stand-in internet with the host, private networks and other
sandboxes closed, E2B's network policy (allow_internet_access, allow_out /
deny_out with IPs, CIDRs and domains, update_network), its persistence
across pause, fork and snapshots, and inbound traffic tokens.

The internet is tests/e2e/net/inet.sh's namespace (started by ../run.sh):
203.0.113.10 and .20 answer "inet <address> host=<Host>" on 80 and 443;
10.99.0.10 is a private host; 10.99.1.10 is private but opened by the test
server's config (`[network] allow_private`). No traffic leaves the machine.
"""

import http.server as httpserver
import socket
import subprocess
import threading
import time
import uuid

import pytest
from e2b import ALL_TRAFFIC, Sandbox, Template

from conftest import PORT, assert_error, http

INET = "203.0.113.10"
INET2 = "203.0.113.20"
PRIVATE = "10.99.0.10"
OPENED = "10.99.1.10"


def fetch(s, url, extra=""):
    """curl `url` in the sandbox: (exit code, body)."""
    r = s.commands.run(
        f"curl -sS --connect-timeout 3 -m 6 {extra} {url}; echo \"rc=$?\"", timeout=30
    )
    body, _, rc = r.stdout.rpartition("rc=")
    return int(rc.strip()), body


def reaches(s, url, extra=""):
    return fetch(s, url, extra)[0] == 0


PROBE = """
import socket, sys
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
        print(target)
    except OSError:
        pass
"""


def reachable(s, targets):
    """The `host:port`s the sandbox can connect to (one process for all)."""
    s.files.write("/tmp/tine-probe.py", PROBE)
    out = s.commands.run("python3 /tmp/tine-probe.py " + " ".join(targets), timeout=120).stdout
    return set(out.split())


def test_default_sandbox_reaches_the_internet_only(fresh):
    s = fresh()
    code, body = fetch(s, f"http://{INET}/")
    assert code == 0 and body.startswith(f"inet {INET} "), body
    assert reaches(s, f"https://{INET}/", "-k")
    assert reaches(s, f"http://{OPENED}/"), "the operator opened 10.99.1.0/24"
    assert not reaches(s, f"http://{PRIVATE}/")
    assert not reaches(s, "http://169.254.169.254/")
    # DNS goes to the gateway, which forwards it to the configured resolver
    # (the stand-in's, which answers 203.0.113.10 for every name).
    assert "nameserver 10.11.0.1" in s.files.read("/etc/resolv.conf")
    code, body = fetch(s, "http://any-name.example/")
    assert code == 0 and body == f"inet {INET} host=any-name.example\n", body
    info = s.get_info()
    assert info.allow_internet_access is True


@pytest.fixture
def host_listener():
    """An HTTP server on every address of the host (the host ns)."""

    class Quiet(httpserver.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "5")
            self.end_headers()
            self.wfile.write(b"host\n")

        def log_message(self, *a):
            pass

    srv = httpserver.ThreadingHTTPServer(("0.0.0.0", 0), Quiet)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()


def host_addresses():
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True).stdout
    addrs = [line.split()[3].split("/")[0] for line in out.splitlines()]
    return [a for a in addrs if not a.startswith("127.")]


def test_the_host_and_other_sandboxes_are_closed(fresh, host_listener):
    a, b = fresh(), fresh()
    # Control: the listener answers on the host's side of the stand-in
    # internet, seen from the stand-in itself.
    ctl = subprocess.run(
        ["ip", "netns", "exec", "e2e-inet", "curl", "-sS", "-m", "5", f"http://203.0.113.1:{host_listener}/"],
        capture_output=True, text=True,
    )
    assert ctl.stdout == "host\n", ctl.stderr
    addrs = host_addresses()
    assert "203.0.113.1" in addrs
    targets = [f"{addr}:{port}" for addr in addrs for port in (host_listener, PORT)]
    assert reachable(a, targets) == set(), "the host is open to a sandbox"
    assert reachable(a, [f"{INET}:80"]) == {f"{INET}:80"}  # the probe works
    # Another sandbox: a server in b's namespace, on its side of b's veth.
    ns = f"tine-{b.sandbox_id}"
    out = subprocess.run(["ip", "-n", ns, "-4", "-o", "addr", "show", "veth0"], capture_output=True, text=True)
    b_addr = out.stdout.split()[3].split("/")[0]
    srv = subprocess.Popen(
        ["ip", "netns", "exec", ns, "python3", "-m", "http.server", "18081", "--bind", b_addr],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(50):
            try:
                with socket.create_connection((b_addr, 18081), timeout=1):
                    break
            except OSError:
                time.sleep(0.1)
        else:
            pytest.fail("the control server in b's namespace did not start")
        assert not reaches(a, f"http://{b_addr}:18081/")
    finally:
        srv.kill()
        srv.wait()
    # Killing a sandbox removes its namespace and both ends of its veth.
    host_end = ".".join(b_addr.split(".")[:3] + [str(int(b_addr.split(".")[3]) - 1)])
    assert host_end in host_addresses()
    b.kill()
    for _ in range(100):
        gone = ns not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        if gone and host_end not in host_addresses():
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"{ns} or its veth ({host_end}) outlived the sandbox")


def test_internet_access_false_and_update_network(fresh):
    s = fresh(allow_internet_access=False)
    assert not reaches(s, f"http://{INET}/")
    assert s.get_info().allow_internet_access is False
    # The resolver is denied with everything else.
    assert "Could not resolve" in s.commands.run(
        "curl -sS -m 6 http://any-name.example/ 2>&1; true", timeout=30
    ).stdout

    s.update_network({"allow_out": [INET], "deny_out": [ALL_TRAFFIC]})
    assert reaches(s, f"http://{INET}/")
    assert not reaches(s, f"http://{INET2}/")
    assert not reaches(s, f"http://{OPENED}/"), "deny_out all covers the opened range too"
    info = s.get_info()
    assert info.network["allow_out"] == [INET]
    assert info.network["deny_out"] == [ALL_TRAFFIC]

    # A CIDR, and deny_out alone.
    s.update_network({"deny_out": ["203.0.113.16/28"]})
    assert reaches(s, f"http://{INET}/")
    assert not reaches(s, f"http://{INET2}/")

    # Omitted fields are cleared: the default policy again.
    s.update_network({})
    assert reaches(s, f"http://{INET2}/")
    assert s.get_info().network.get("deny_out") in (None, [])


def test_domains_pass_by_name_and_survive_pause_and_fork(fresh):
    s = fresh(network={"allow_out": ["allowed.test"], "deny_out": [ALL_TRAFFIC]}, timeout=600)
    s.commands.run(
        f"printf '{INET} allowed.test\\n{INET} other.test\\n' >> /etc/hosts", user="root"
    )

    def check(box):
        code, body = fetch(box, "http://allowed.test/")
        assert code == 0 and body == f"inet {INET} host=allowed.test\n", body
        code, body = fetch(box, "https://allowed.test/", "-k")
        assert code == 0 and body == f"inet {INET} host=allowed.test\n", body
        # Another name, and the raw address, are refused.
        code, body = fetch(box, "http://other.test/", "--fail")
        assert code != 0, body
        assert not reaches(box, "https://other.test/", "-k")
        assert not reaches(box, f"http://{INET}/", "--fail")
        # Other ports are not by name: the IP rules (deny all) hold.
        assert not reaches(box, f"http://allowed.test:8080/")

    check(s)
    assert s.pause() is True
    s = Sandbox.connect(s.sandbox_id)
    check(s)
    kids = s.fork(count=1, timeout=600)
    try:
        assert len(kids) == 1
        check(kids[0])
        assert kids[0].get_info().network["allow_out"] == ["allowed.test"]
    finally:
        for k in kids:
            k.kill()


def test_an_allowed_name_sent_to_another_address_reaches_only_the_names_server(fresh):
    """The attack: with only `allowed.test` let out, the guest sends that
    name (Host, SNI) to an address of its choosing. The connection goes to
    the address the sandboxes' resolver gives for the name (the stand-in
    DNS answers INET for every name), never to INET2."""
    s = fresh(network={"allow_out": ["allowed.test"], "deny_out": [ALL_TRAFFIC]})
    for url, extra in [
        ("http://allowed.test/", f"--resolve allowed.test:80:{INET2}"),
        ("https://allowed.test/", f"-k --resolve allowed.test:443:{INET2}"),
        (f"http://{INET2}/", "-H 'Host: allowed.test'"),
    ]:
        code, body = fetch(s, url, extra)
        assert code == 0 and body == f"inet {INET} host=allowed.test\n", (url, body)


def test_snapshot_keeps_the_policy(fresh):
    import inspect

    if inspect.signature(Sandbox.create).parameters["allow_internet_access"].default is not None:
        pytest.skip("this SDK sends allow_internet_access=True at every create, which a "
                    "snapshot's policy does not override (nor on E2B)")
    s = fresh(allow_internet_access=False)
    snap = s.create_snapshot()
    try:
        child = fresh(template=snap.snapshot_id)
        assert not reaches(child, f"http://{INET}/")
        assert child.get_info().allow_internet_access is False
    finally:
        Sandbox.delete_snapshot(snap.snapshot_id)


ECHO_HOST = (
    "import http.server as h\n"
    "class H(h.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        b = self.headers.get('Host', '').encode()\n"
    "        self.send_response(200); self.send_header('Content-Length', str(len(b))); self.end_headers(); self.wfile.write(b)\n"
    "h.HTTPServer(('0.0.0.0', 8000), H).serve_forever()\n"
)


def get_until_up(host, headers=None):
    status, body = None, b""
    for _ in range(100):
        status, _, body = http("GET", "/", headers={"Host": host, **(headers or {})}, key=None)
        if status != 502:
            break
        time.sleep(0.1)
    return status, body


def test_private_traffic_needs_the_token_and_host_is_masked(fresh):
    s = fresh(network={"allow_public_traffic": False, "mask_request_host": "app.internal:${PORT}"})
    token = s.traffic_access_token
    assert token
    s.files.write("/tmp/echo_host.py", ECHO_HOST)
    s.commands.run("python3 /tmp/echo_host.py", background=True)
    host = s.get_host(8000)
    status, body = get_until_up(host, {"e2b-traffic-access-token": token})
    assert status == 200, body
    assert body == b"app.internal:8000"
    status, _, body = http("GET", "/", headers={"Host": host}, key=None)
    assert status == 403 and b"e2b-traffic-access-token" in body
    status, _, _ = http("GET", "/", headers={"Host": host, "e2b-traffic-access-token": "x" * len(token)}, key=None)
    assert status == 403
    # The agent's port still takes the access token, not the traffic token.
    assert s.commands.run("true").exit_code == 0

    # A public sandbox has no traffic token and needs none.
    p = fresh()
    assert p.traffic_access_token is None


TLS_SERVER = (
    "import http.server as h, ssl\n"
    "class H(h.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        self.send_response(200); self.send_header('Content-Length', '3'); self.end_headers(); self.wfile.write(b'tls')\n"
    "srv = h.HTTPServer(('0.0.0.0', 8443), H)\n"
    "ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); ctx.load_cert_chain('/tmp/cert.pem', '/tmp/key.pem')\n"
    "srv.socket = ctx.wrap_socket(srv.socket, server_side=True)\n"
    "srv.serve_forever()\n"
)


def test_https_ports_reach_a_tls_server_in_the_sandbox(fresh, tmp_path):
    import inspect

    import e2b.sandbox.sandbox_api as api
    if "https_ports" not in inspect.getsource(api):
        pytest.skip("this SDK does not send network.https_ports")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=sandbox", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )
    s = fresh(network={"https_ports": [8443]})
    s.files.write("/tmp/key.pem", key.read_text())
    s.files.write("/tmp/cert.pem", cert.read_text())
    s.files.write("/tmp/tls_server.py", TLS_SERVER)
    s.commands.run("python3 /tmp/tls_server.py", background=True)
    status, body = get_until_up(s.get_host(8443))
    assert status == 200 and body == b"tls", body
    assert s.get_info().network["https_ports"] == [8443]
    # Without https_ports the same server gets plain HTTP and fails.
    p = fresh()
    p.files.write("/tmp/key.pem", key.read_text())
    p.files.write("/tmp/cert.pem", cert.read_text())
    p.files.write("/tmp/tls_server.py", TLS_SERVER)
    p.commands.run("python3 /tmp/tls_server.py", background=True)
    status, _ = get_until_up(p.get_host(8443))
    assert status != 200


def test_bad_network_input_is_a_clear_400(sbx):
    def create(body):
        return http("POST", "/v2/sandboxes", {"templateID": "base", **body})

    cases = [
        ({"network": {"allowOut": ["10.0.0.0/33"]}}, "not a valid IPv4"),
        ({"network": {"denyOut": [""]}}, "empty entry"),
        ({"network": {"allowOut": ["bad domain!"]}}, "not a valid domain"),
        ({"network": {"denyOut": [f"1.2.{i // 256}.{i % 256}" for i in range(300)]}}, "at most 256"),
        ({"network": {"dnsServers": ["dns.test"]}}, "not an IPv4"),
        ({"network": {"egressProxy": {"address": "p.test"}}}, "egress_proxy"),
        ({"network": {"httpsPorts": [0]}}, "https_ports"),
        ({"network": {"rules": {"api test": [{"transform": {"headers": {"a": "b"}}}]}}}, "not a domain"),
        ({"network": {"allowOut": "1.2.3.4"}}, "invalid network"),
    ]
    for body, words in cases:
        doc = assert_error(create(body), 400)
        assert words in doc["message"], (body, doc)
    doc = assert_error(http("PUT", f"/sandboxes/{sbx.sandbox_id}/network", {"allowOut": ["::1"]}), 400)
    assert "IPv6" in doc["message"]
    assert_error(http("PUT", "/sandboxes/no-such-sandbox/network", {}), 404)
    # A bad update changes nothing.
    assert reaches(sbx, f"http://{INET}/")


def test_builds_reach_the_internet(fresh):
    name = f"e2e-net-build-{uuid.uuid4().hex[:6]}"
    t = Template().from_template("base").run_cmd(
        f"curl -sS -m 10 http://{INET}/ > /tmp/from-build && echo {name} >> /tmp/from-build"
    )
    Template.build(t, name, cpu_count=1, memory_mb=256)
    try:
        s = fresh(template=name)
        assert s.files.read("/tmp/from-build") == f"inet {INET} host={INET}\n{name}\n"
    finally:
        http("DELETE", f"/templates/{name}")
