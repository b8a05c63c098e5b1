"""Cluster mode in domain mode over HTTPS: the SDK gets only E2B_DOMAIN
(and tine's CA), and reaches the API and every sandbox through a gateway
serving TLS for the domain and its wildcard (`api.D`, `<port>-<id>.D`).

Run by tests/e2e/cluster/run.sh after the nodes were restarted for the
domain and gateway 2 with `[tls]`; E2B_API_URL and E2B_SANDBOX_URL are
unset, SSL_CERT_FILE names the gateways' CA.
"""

import base64
import os
import socket
import ssl

from e2b import Sandbox

DOMAIN = os.environ["E2B_DOMAIN"]
HOST, PORT = DOMAIN.rsplit(":", 1)

# A server in the guest that takes an HTTP upgrade, answers 101 and then
# echoes every line it reads back in upper case (a WebSocket server does
# the same dance; the bytes after the 101 are the proxies' to splice).
UPGRADE_SERVER = r"""
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 8765))
s.listen(4)
while True:
    c, _ = s.accept()
    f = c.makefile("rwb", buffering=0)
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        b = f.read(1)
        if not b:
            break
        head += b
    if b"upgrade: tine-echo" not in head.lower():
        c.sendall(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
        c.close()
        continue
    c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: tine-echo\r\n\r\n")
    while True:
        line = f.readline()
        if not line:
            break
        c.sendall(line.upper())
    c.close()
"""


def test_the_sdk_with_only_a_domain_creates_runs_and_reads_files_through_the_tls_gateway():
    s = Sandbox.create(timeout=300)
    try:
        assert s.commands.run("echo hello over tls").stdout.strip() == "hello over tls"
        s.files.write("/tmp/f.txt", "through the domain")
        assert s.files.read("/tmp/f.txt") == "through the domain"
        assert s.get_host(8000) == f"8000-{s.sandbox_id}.{DOMAIN}"
        again = Sandbox.connect(s.sandbox_id)
        assert again.commands.run("cat /tmp/f.txt").stdout == "through the domain"
        ids = [x.sandbox_id for x in Sandbox.list().next_items()]
        assert s.sandbox_id in ids
    finally:
        s.kill()


def test_an_upgraded_connection_is_spliced_through_gateway_and_node():
    s = Sandbox.create(timeout=300)
    try:
        s.files.write("/tmp/upgrade_server.py", UPGRADE_SERVER)
        s.commands.run("python3 /tmp/upgrade_server.py", background=True)
        s.commands.run("for i in $(seq 50); do ss -ltn | grep -q ':8765 ' && exit 0; sleep 0.2; done; exit 1")
        host = s.get_host(8765)
        ctx = ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])
        raw = socket.create_connection(("127.0.0.1", int(PORT)), timeout=30)
        conn = ctx.wrap_socket(raw, server_hostname=host.rsplit(":", 1)[0])
        key = base64.b64encode(os.urandom(16)).decode()
        conn.sendall(
            f"GET /echo HTTP/1.1\r\nHost: {host}\r\nConnection: Upgrade\r\nUpgrade: tine-echo\r\n"
            f"Sec-Example-Key: {key}\r\n\r\n".encode()
        )
        f = conn.makefile("rb", buffering=0)
        status = f.readline()
        assert status.startswith(b"HTTP/1.1 101"), status
        while f.readline() not in (b"\r\n", b""):
            pass
        for word in (b"first", b"second line", b"third"):
            conn.sendall(word + b"\n")
            assert f.readline() == word.upper() + b"\n"
        conn.close()
    finally:
        s.kill()


def test_a_certificate_for_another_name_is_not_served():
    ctx = ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])
    raw = socket.create_connection(("127.0.0.1", int(PORT)), timeout=10)
    try:
        ctx.wrap_socket(raw, server_hostname="example.test")
        raise AssertionError("a certificate for example.test was accepted")
    except ssl.SSLCertVerificationError:
        pass
    finally:
        raw.close()
