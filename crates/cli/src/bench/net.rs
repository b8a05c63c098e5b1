//! P10: a 100 MiB download from a stand-in internet host through a
//! sandbox's egress path (guest → tap → its namespace's firewall and NAT →
//! veth → the host's NAT), against the same download made by the host
//! itself; and HTTPS requests through the injecting proxy (a header
//! transform with a secret: TLS terminated on the host and made again to
//! the destination) against the same requests through the plain egress
//! path. The stand-in is a namespace the bench makes (`tbench-inet`,
//! 198.51.100.10, TEST-NET-2, reached through a veth) serving zeros over
//! HTTP and small answers over HTTPS (a certificate from the CA the bench
//! server trusts, [`super::env::INET_CA_DIR`]); no traffic leaves the
//! machine.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::report::Row;
use super::{Ctx, Out};

const NS: &str = "tbench-inet";
const HOST_IF: &str = "tbench0";
const SERVER: &str = "198.51.100.10";
/// The stand-in's HTTPS name: a transform that carries a secret names its
/// host (an address would serve whatever site the guest names to it).
const SERVER_NAME: &str = "inet.bench.test";
const BYTES: u64 = 100 << 20;

fn ip(args: &[&str]) -> anyhow::Result<()> {
    let out = std::process::Command::new("ip")
        .args(args)
        .output()
        .context("running ip")?;
    if !out.status.success() {
        bail!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Bytes of each HTTPS answer.
const SMALL: usize = 1024;
/// HTTPS requests a sandbox makes per iteration.
const REQUESTS: usize = 20;

/// The stand-in internet host; removed on drop.
struct StandIn {
    server: tokio::task::JoinHandle<()>,
    tls: Option<tokio::task::JoinHandle<()>>,
    /// HTTPS requests that arrived with an `Authorization: Bearer` header.
    authorized: Arc<AtomicU64>,
    /// The CA of its HTTPS certificate (PEM).
    ca_pem: Option<String>,
}

impl StandIn {
    /// With HTTPS when `ca_dir` holds the CA to sign its certificate.
    fn up(ca_dir: Option<&std::path::Path>) -> anyhow::Result<Self> {
        Self::remove();
        ip(&["netns", "add", NS])?;
        ip(&[
            "link", "add", HOST_IF, "type", "veth", "peer", "name", "eth0", "netns", NS,
        ])?;
        ip(&["addr", "add", "198.51.100.1/24", "dev", HOST_IF])?;
        ip(&["link", "set", HOST_IF, "up"])?;
        ip(&["-n", NS, "link", "set", "lo", "up"])?;
        ip(&[
            "-n",
            NS,
            "addr",
            "add",
            &format!("{SERVER}/24"),
            "dev",
            "eth0",
        ])?;
        ip(&["-n", NS, "link", "set", "eth0", "up"])?;
        ip(&["-n", NS, "route", "add", "default", "via", "198.51.100.1"])?;
        let ns = tine_vmm::netns::Netns::open(NS)?;
        let listener = ns.listen_at(SocketAddr::from(([198, 51, 100, 10], 80)))?;
        let server = tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                tokio::spawn(serve(conn, None));
            }
        });
        let authorized = Arc::new(AtomicU64::new(0));
        let (mut tls, mut ca_pem) = (None, None);
        if let Some(dir) = ca_dir {
            let ca = tine_server::network::ca::EgressCa::load_or_create(dir)?;
            let acceptor = tokio_rustls::TlsAcceptor::from(ca.server_config(SERVER_NAME)?);
            ca_pem = Some(ca.pem().to_string());
            let listener = ns.listen_at(SocketAddr::from(([198, 51, 100, 10], 443)))?;
            let seen = authorized.clone();
            tls = Some(tokio::spawn(async move {
                while let Ok((conn, _)) = listener.accept().await {
                    let (acceptor, seen) = (acceptor.clone(), seen.clone());
                    tokio::spawn(async move {
                        if let Ok(Ok(s)) =
                            tokio::time::timeout(Duration::from_secs(10), acceptor.accept(conn))
                                .await
                        {
                            serve(s, Some(seen)).await;
                        }
                    });
                }
            }));
        }
        Ok(Self {
            server,
            tls,
            authorized,
            ca_pem,
        })
    }

    fn remove() {
        let _ = ip(&["netns", "delete", NS]);
        let _ = ip(&["link", "delete", HOST_IF]);
    }
}

impl Drop for StandIn {
    fn drop(&mut self) {
        self.server.abort();
        if let Some(t) = &self.tls {
            t.abort();
        }
        Self::remove();
    }
}

/// Answer one `GET /bytes?n=N` with N zero bytes; any other path with
/// [`SMALL`] bytes. `authorized` counts requests with a bearer token.
async fn serve<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    mut conn: S,
    authorized: Option<Arc<AtomicU64>>,
) {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 8192 {
        match conn.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    let text = String::from_utf8_lossy(&head);
    if let Some(seen) = &authorized {
        if text
            .lines()
            .any(|l| l.to_ascii_lowercase().starts_with("authorization: bearer "))
        {
            seen.fetch_add(1, Ordering::Relaxed);
        }
    }
    let n: u64 = match text.split_once("n=") {
        Some((_, r)) => r
            .split(|c: char| !c.is_ascii_digit())
            .next()
            .and_then(|d| d.parse().ok())
            .unwrap_or(0),
        None => SMALL as u64,
    };
    let header = format!("HTTP/1.1 200 OK\r\nContent-Length: {n}\r\nConnection: close\r\n\r\n");
    if conn.write_all(header.as_bytes()).await.is_err() {
        return;
    }
    let chunk = vec![0u8; 256 << 10];
    let mut left = n;
    while left > 0 {
        let k = left.min(chunk.len() as u64) as usize;
        if conn.write_all(&chunk[..k]).await.is_err() {
            return;
        }
        left -= k as u64;
    }
    let _ = conn.shutdown().await;
}

/// The guest's HTTPS client: REQUESTS requests to `SERVER_NAME` at
/// `SERVER`, each on a new connection, verified (against CAFILE, else the
/// guest's trust store); prints their latencies in ms as JSON.
const HTTPS_CLIENT: &str = r#"
import http.client, json, socket, ssl, sys, time
n, ca = int(sys.argv[1]), (sys.argv[2] if len(sys.argv) > 2 else None)
ctx = ssl.create_default_context(cafile=ca) if ca else ssl.create_default_context()

class Conn(http.client.HTTPSConnection):
    # inet.bench.test (the name the transform is for) at the stand-in's
    # address, without a resolver.
    def connect(self):
        sock = socket.create_connection(("198.51.100.10", self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)

out = []
for _ in range(n):
    t = time.perf_counter()
    c = Conn("inet.bench.test", 443, context=ctx, timeout=20)
    c.request("GET", "/small")
    r = c.getresponse()
    body = r.read()
    c.close()
    assert r.status == 200 and len(body) == 1024, (r.status, len(body))
    out.append((time.perf_counter() - t) * 1e3)
print(json.dumps(out))
"#;

/// Write `text` to `path` in the sandbox.
async fn put(ctx: &Ctx, sb: &crate::client::Sandbox, path: &str, text: &str) -> anyhow::Result<()> {
    let cmd = format!("cat > {path} <<'TINE_EOF'\n{text}\nTINE_EOF");
    let r = ctx.api.exec(sb, &cmd, Duration::from_secs(60)).await?;
    anyhow::ensure!(r.exit_code == 0, "writing {path} in the sandbox failed");
    Ok(())
}

/// One round of the HTTPS client in `sb`: its latencies, ms.
async fn https_round(
    ctx: &Ctx,
    sb: &crate::client::Sandbox,
    ca: Option<&str>,
) -> anyhow::Result<Vec<f64>> {
    let cmd = format!("python3 /tmp/p10-https.py {REQUESTS} {}", ca.unwrap_or(""));
    let r = ctx.api.exec(sb, &cmd, Duration::from_secs(600)).await?;
    if r.exit_code != 0 {
        bail!(
            "the HTTPS client failed (exit {}): {}",
            r.exit_code,
            String::from_utf8_lossy(&r.stderr).trim()
        );
    }
    serde_json::from_slice(&r.stdout).context("the HTTPS client's output")
}

/// HTTPS through the injecting proxy (a transform setting a secret in
/// `Authorization`) vs. the plain egress path, in one run.
async fn injected_https(ctx: &Ctx, inet: &StandIn, out: &mut Out) -> anyhow::Result<()> {
    let n = ctx.iterations(3);
    let ca = inet
        .ca_pem
        .as_deref()
        .context("the stand-in has no HTTPS (the bench did not start the server)")?;
    let secret = format!("tine-bench-p10-{}", std::process::id());
    ctx.api
        .call(
            hyper::Method::POST,
            "/secrets",
            Some(serde_json::json!({"name": secret, "value": "bench-token"})),
        )
        .await?;
    let rules = serde_json::json!({"network": {"rules": {SERVER_NAME: [{"transform": {"headers": {
        "Authorization": format!("Bearer ${{e2b.secrets.{secret}}}")}}}]}}});
    let result = async {
        let plain = ctx.api.create(ctx.args.cpus, ctx.args.memory_mb).await?;
        let injected = ctx
            .api
            .create_with(ctx.args.cpus, ctx.args.memory_mb, rules)
            .await?;
        for sb in [&plain, &injected] {
            put(ctx, sb, "/tmp/p10-https.py", HTTPS_CLIENT).await?;
        }
        put(ctx, &plain, "/tmp/p10-ca.pem", ca).await?;
        // Warm both (the proxy's certificate for the host, Python's pages).
        https_round(ctx, &plain, Some("/tmp/p10-ca.pem")).await?;
        https_round(ctx, &injected, None).await?;
        let before = inet.authorized.load(Ordering::Relaxed);
        let (mut via, mut direct) = (Vec::new(), Vec::new());
        for i in 1..=n {
            ctx.step(format!("HTTPS {i}/{n}"));
            via.extend(https_round(ctx, &injected, None).await?);
            direct.extend(https_round(ctx, &plain, Some("/tmp/p10-ca.pem")).await?);
        }
        let carried = inet.authorized.load(Ordering::Relaxed) - before;
        if carried != via.len() as u64 {
            bail!(
                "{carried} of {} requests through the injecting proxy arrived with the header",
                via.len()
            );
        }
        let rate = |v: &[f64]| v.len() as f64 / (v.iter().sum::<f64>() / 1e3);
        let (via_rate, direct_rate) = (rate(&via), rate(&direct));
        let mut row = Row::new(
            "P10",
            "HTTPS request (new connection) through the injecting proxy",
            "ms",
        )
        .samples(via)
        .floor("the same requests through the plain egress path", direct)
        .param("requests_per_round", REQUESTS as u64);
        row.target = "reported (no target)".into();
        if let (Some(s), Some(f)) = (row.summary, row.floor) {
            row.ratio = Some(s.p50 / f.p50);
            row = row
                .param("injected_req_s", via_rate)
                .param("plain_req_s", direct_rate);
        }
        out.rows.push(row);
        ctx.api.kill(&plain.id).await?;
        ctx.api.kill(&injected.id).await?;
        anyhow::Ok(())
    }
    .await;
    let _ = ctx
        .api
        .call(hyper::Method::DELETE, &format!("/secrets/{secret}"), None)
        .await;
    result
}

fn curl_cmd(bytes: u64) -> String {
    format!("curl -sS -o /dev/null -w '%{{size_download}} %{{time_total}}' http://{SERVER}/bytes?n={bytes}")
}

/// (bytes, seconds) from curl's `-w` line.
fn parse_curl(out: &str) -> anyhow::Result<(u64, f64)> {
    let mut it = out.split_whitespace();
    let (Some(b), Some(t)) = (it.next(), it.next()) else {
        bail!("unexpected curl output {out:?}");
    };
    Ok((b.parse()?, t.parse()?))
}

async fn from_host() -> anyhow::Result<f64> {
    let out = tokio::process::Command::new("sh")
        .args(["-c", &curl_cmd(BYTES)])
        .output()
        .await?;
    let (b, secs) = parse_curl(&String::from_utf8_lossy(&out.stdout))?;
    if b != BYTES {
        bail!("the host downloaded {b} bytes of {BYTES}");
    }
    Ok(secs * 1e3)
}

pub async fn p10(ctx: &Ctx, out: &mut Out) -> anyhow::Result<()> {
    let n = ctx.iterations(3);
    let ca_dir = ctx
        .own
        .is_some()
        .then(|| ctx.paths.data_dir.join(super::env::INET_CA_DIR));
    let inet = StandIn::up(ca_dir.as_deref()).context("setting up the stand-in internet host")?;
    let sb = ctx.api.create(ctx.args.cpus, ctx.args.memory_mb).await?;
    let timeout = Duration::from_secs(300);
    // Warm both (curl's pages, TCP paths, conntrack).
    ctx.api.exec(&sb, &curl_cmd(1 << 20), timeout).await?;
    from_host().await?;
    let (mut guest, mut host) = (Vec::new(), Vec::new());
    for i in 1..=n {
        ctx.step(format!("{i}/{n}"));
        let t = Instant::now();
        let r = ctx.api.exec(&sb, &curl_cmd(BYTES), timeout).await?;
        let (b, secs) = parse_curl(&String::from_utf8_lossy(&r.stdout))?;
        if r.exit_code != 0 || b != BYTES {
            bail!(
                "the sandbox downloaded {b} of {BYTES} bytes (exit {}): {}",
                r.exit_code,
                String::from_utf8_lossy(&r.stderr)
            );
        }
        out.stage(
            "sandbox: commands.run around the download",
            super::create::ms(t),
        );
        guest.push(secs * 1e3);
        host.push(from_host().await?);
    }
    let mib_s = |ms: f64| (BYTES as f64 / (1 << 20) as f64) / (ms / 1e3);
    let mut row = Row::new("P10", "100 MiB download through the egress path", "ms")
        .samples(guest)
        .floor("the same download by the host", host)
        .param("bytes", BYTES);
    row.target = "reported (no target)".into();
    if let (Some(s), Some(f)) = (row.summary, row.floor) {
        row.ratio = Some(s.p50 / f.p50);
        row = row
            .param("sandbox_mib_s", mib_s(s.p50))
            .param("host_mib_s", mib_s(f.p50));
    }
    out.rows.push(row);
    ctx.api.kill(&sb.id).await?;
    // The injecting proxy must trust the stand-in's CA, which only the
    // bench's own server is configured with: with --server the row is left
    // out, as P1's warm-pool row is.
    if inet.ca_pem.is_none() {
        return Ok(());
    }
    if let Err(e) = injected_https(ctx, &inet, out).await {
        let mut row = Row::new(
            "P10",
            "HTTPS request (new connection) through the injecting proxy",
            "ms",
        );
        row.error = Some(format!("{e:#}"));
        out.rows.push(row);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn curl_write_out_parses() {
        assert_eq!(parse_curl("104857600 1.25").unwrap(), (104857600, 1.25));
        assert!(parse_curl("").is_err());
    }
}
