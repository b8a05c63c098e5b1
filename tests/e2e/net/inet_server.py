"""The stand-in "internet" host of the network tests, run inside the test's
own network namespace, on every address of the namespace:

- HTTP on port 80 and HTTPS on 443 (a certificate for *.inet.test from the
  test CA). Each answer names the address it arrived at and the Host it
  was sent with; `/bytes?n=N` streams N zero bytes; `/headers` answers the
  request's headers as JSON, each value replaced by its SHA-256 (a test
  sees what arrived without the sandbox seeing a secret), and records them
  in full in seen.jsonl beside CERT, for the test on the host;
- TCP port 2222, whose server speaks first: "banner <address>";
- DNS on UDP port 53, answering every A query with 203.0.113.10.

Usage: inet_server.py CERT KEY
"""

import hashlib
import http.server
import json
import os
import socket
import socketserver
import ssl
import sys
import threading
import urllib.parse


SEEN = None  # where /headers requests are recorded in full (main sets it)


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        url = urllib.parse.urlparse(self.path)
        if url.path == "/bytes":
            n = int(urllib.parse.parse_qs(url.query).get("n", ["0"])[0])
            self.send_response(200)
            self.send_header("Content-Length", str(n))
            self.end_headers()
            chunk = bytes(1 << 16)
            while n > 0:
                k = min(n, len(chunk))
                self.wfile.write(chunk[:k])
                n -= k
            return
        if url.path == "/headers":
            # The relying party's side: what arrived, in clear, for the
            # test on the host only (the answer carries hashes).
            with open(SEEN, "a") as log:
                log.write(json.dumps({"path": self.path, "headers": dict(self.headers.items())}) + "\n")
            seen = {}
            for k, v in self.headers.items():
                seen.setdefault(k.lower(), []).append(hashlib.sha256(v.encode()).hexdigest())
            body = json.dumps(seen).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        local = self.connection.getsockname()[0]
        body = f"inet {local} host={self.headers.get('Host', '')}\n".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def dns_answer(query):
    """A reply to a DNS query: the same question, one A record 203.0.113.10."""
    if len(query) < 12:
        return None
    qid, qdcount = query[:2], int.from_bytes(query[4:6], "big")
    end = 12
    while end < len(query) and query[end] != 0:
        end += 1 + query[end]
    question = query[12 : end + 5]
    if qdcount != 1 or len(question) < 5:
        return None
    qtype = int.from_bytes(question[-4:-2], "big")
    answers = b""
    if qtype == 1:
        answers = b"\xc0\x0c" + (1).to_bytes(2, "big") + (1).to_bytes(2, "big") \
            + (60).to_bytes(4, "big") + (4).to_bytes(2, "big") + bytes([203, 0, 113, 10])
    header = qid + b"\x81\x80" + (1).to_bytes(2, "big") + (1 if answers else 0).to_bytes(2, "big") \
        + b"\x00\x00\x00\x00"
    return header + question + answers


def serve_dns():
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", 53))
    while True:
        query, peer = sock.recvfrom(4096)
        reply = dns_answer(query)
        if reply:
            sock.sendto(reply, peer)


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def serve_banner(port):
    """A TCP port whose server speaks first: "banner <local address>\\n"."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("0.0.0.0", port))
    sock.listen(64)
    while True:
        conn, _ = sock.accept()
        try:
            conn.sendall(f"banner {conn.getsockname()[0]}\n".encode())
        finally:
            conn.close()


def main():
    global SEEN
    cert, key = sys.argv[1], sys.argv[2]
    SEEN = os.path.join(os.path.dirname(os.path.abspath(cert)), "seen.jsonl")
    plain = Server(("0.0.0.0", 80), Handler)
    tls = Server(("0.0.0.0", 443), Handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    tls.socket = ctx.wrap_socket(tls.socket, server_side=True)
    threading.Thread(target=tls.serve_forever, daemon=True).start()
    threading.Thread(target=serve_dns, daemon=True).start()
    threading.Thread(target=serve_banner, args=(2222,), daemon=True).start()
    print("ready", flush=True)
    plain.serve_forever()


if __name__ == "__main__":
    main()
