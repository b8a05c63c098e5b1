//! P10: a 100 MiB download from a stand-in internet host through a
//! sandbox's egress path (guest → tap → its namespace's firewall and NAT →
//! veth → the host's NAT), against the same download made by the host
//! itself. The stand-in is a namespace the bench makes (`tbench-inet`,
//! 198.51.100.10, TEST-NET-2, reached through a veth) serving zeros over
//! HTTP; no traffic leaves the machine.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::report::Row;
use super::{Ctx, Out};

const NS: &str = "tbench-inet";
const HOST_IF: &str = "tbench0";
const SERVER: &str = "198.51.100.10";
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

/// The stand-in internet host; removed on drop.
struct StandIn {
    server: tokio::task::JoinHandle<()>,
}

impl StandIn {
    fn up() -> anyhow::Result<Self> {
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
                tokio::spawn(serve_zeros(conn));
            }
        });
        Ok(Self { server })
    }

    fn remove() {
        let _ = ip(&["netns", "delete", NS]);
        let _ = ip(&["link", "delete", HOST_IF]);
    }
}

impl Drop for StandIn {
    fn drop(&mut self) {
        self.server.abort();
        Self::remove();
    }
}

/// Answer one `GET /bytes?n=N` with N zero bytes.
async fn serve_zeros(mut conn: tokio::net::TcpStream) {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 8192 {
        match conn.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    let text = String::from_utf8_lossy(&head);
    let n: u64 = text
        .split_once("n=")
        .and_then(|(_, r)| r.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|d| d.parse().ok())
        .unwrap_or(0);
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
    let _inet = StandIn::up().context("setting up the stand-in internet host")?;
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
