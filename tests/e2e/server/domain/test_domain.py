"""Domain mode over HTTPS (`tine serve --domain D --tls`): the SDK gets only
E2B_DOMAIN, E2B_API_KEY and tine's CA (SSL_CERT_FILE), and reaches the API
at https://api.D and sandboxes at https://<port>-<id>.D, as it reaches E2B.
Names under D (tine.localhost) resolve to loopback through nss-myhostname
(tests/e2e/setup.sh)."""

import os
import ssl
import time
import urllib.request

from e2b import Sandbox

DOMAIN = os.environ["E2B_DOMAIN"]
for var in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_DEBUG"):
    assert not os.environ.get(var), f"{var} must be unset in domain mode"


def get(url):
    ctx = ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])
    with urllib.request.urlopen(url, timeout=60, context=ctx) as r:
        return r.status, r.read()


def test_the_sdk_works_with_only_the_domain():
    sbx = Sandbox.create(metadata={"tine-e2e": "domain"})
    try:
        assert sbx.commands.run("echo over-tls").stdout == "over-tls\n"
        sbx.files.write("/tmp/d.txt", "domain")
        assert sbx.files.read("/tmp/d.txt") == "domain"
        assert [i.sandbox_id for i in Sandbox.list().next_items() if i.sandbox_id == sbx.sandbox_id]

        # Signed URLs point at https://49983-<id>.D and work without headers.
        url = sbx.download_url("/tmp/d.txt", use_signature_expiration=60)
        assert url.startswith(f"https://49983-{sbx.sandbox_id}.{DOMAIN}/"), url
        assert get(url) == (200, b"domain")

        # get_host(port): a server in the sandbox, over HTTPS.
        sbx.commands.run("mkdir -p /tmp/www && echo hello-tls > /tmp/www/index.html")
        srv = sbx.commands.run("cd /tmp/www && exec python3 -m http.server 8000", background=True)
        host = sbx.get_host(8000)
        assert host == f"8000-{sbx.sandbox_id}.{DOMAIN}"
        got = None
        for _ in range(100):
            try:
                got = get(f"https://{host}/index.html")
                break
            except Exception:
                time.sleep(0.1)
        assert got == (200, b"hello-tls\n")
        srv.kill()

        again = Sandbox.connect(sbx.sandbox_id)
        assert again.commands.run("echo again").stdout == "again\n"
    finally:
        sbx.kill()
