//! The egress proxy of one sandbox whose policy names domains: its
//! firewall redirects the guest's new TCP connections to ports 80 and 443
//! here (a listener inside the sandbox's namespace); the proxy reads the
//! name the client asks for (SNI or Host), decides with the policy, and
//! splices the connection to its destination, dialled from the sandbox's
//! namespace so the host's rules for sandboxes still apply. A connection
//! let out only for its name goes to an address the sandboxes' resolver
//! gives for that name (the one dialled, if it is one of them), never to
//! whatever address the guest sent an allowed name to.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::inject::Injector;
use super::sniff::{sniff, Sniffed, MAX_HEAD};
use super::Egress;

/// How long a client may take to send its hello or request head.
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// How long dialling the destination may take.
const DIAL_TIMEOUT: Duration = Duration::from_secs(15);
/// Connections one sandbox may have through its proxy at once; more are
/// closed on arrival.
const MAX_CONNECTIONS: usize = 1024;

/// A running proxy; dropping it stops accepting (connections already
/// spliced go on until they end).
pub struct EgressProxy {
    task: Option<tokio::task::JoinHandle<()>>,
}

impl EgressProxy {
    /// Serve `listener` (in the sandbox's namespace) with `egress`'s
    /// policy; connections to hosts with transforms go through `inject`.
    pub fn start(
        listener: tokio::net::TcpListener,
        egress: Arc<Egress>,
        inject: Option<Arc<Injector>>,
    ) -> Self {
        let sandbox = egress.sandbox.clone();
        let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
        let task = tokio::spawn(async move {
            loop {
                let conn = match listener.accept().await {
                    Ok((c, _)) => c,
                    Err(e) => {
                        tracing::warn!(sandbox, "egress proxy: accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let Ok(slot) = slots.clone().try_acquire_owned() else {
                    tracing::warn!(
                        sandbox,
                        "egress proxy: {MAX_CONNECTIONS} connections open; closing a new one"
                    );
                    continue;
                };
                let (egress, inject, sandbox) = (egress.clone(), inject.clone(), sandbox.clone());
                tokio::spawn(async move {
                    let _slot = slot;
                    if let Err(e) = serve(conn, egress, inject).await {
                        tracing::debug!(sandbox, "egress proxy: {e}");
                    }
                });
            }
        });
        Self { task: Some(task) }
    }

    /// Stop accepting and wait until the listener is closed.
    pub async fn stop(mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
            let _ = task.await;
        }
    }
}

impl Drop for EgressProxy {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

/// Where the firewall's redirect was going.
fn original_dst(conn: &TcpStream) -> std::io::Result<SocketAddrV4> {
    let sa = nix::sys::socket::getsockopt(conn, nix::sys::socket::sockopt::OriginalDst)
        .map_err(std::io::Error::from)?;
    Ok(SocketAddrV4::new(
        Ipv4Addr::from(u32::from_be(sa.sin_addr.s_addr)),
        u16::from_be(sa.sin_port),
    ))
}

async fn read_head(conn: &mut TcpStream, buf: &mut Vec<u8>) -> Option<String> {
    let mut chunk = [0u8; 4096];
    loop {
        match sniff(buf) {
            Sniffed::Name(n) => return Some(n),
            Sniffed::NoName => return None,
            Sniffed::More => {}
        }
        let n = conn.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.len() >= MAX_HEAD {
            return match sniff(buf) {
                Sniffed::Name(n) => Some(n),
                _ => None,
            };
        }
    }
}

async fn serve(
    mut conn: TcpStream,
    egress: Arc<Egress>,
    inject: Option<Arc<Injector>>,
) -> std::io::Result<()> {
    let dst = original_dst(&conn)?;
    let mut head = Vec::new();
    // Only connections to ports 80 and 443 name their host; others (sent
    // here to be tunnelled) may wait for the server to speak first.
    let name = if tine_vmm::firewall::INTERCEPTED_PORTS.contains(&dst.port()) {
        tokio::time::timeout(HEAD_TIMEOUT, read_head(&mut conn, &mut head))
            .await
            .unwrap_or(None)
    } else {
        None
    };
    let allowed = egress
        .policy
        .allows(&egress.site, *dst.ip(), name.as_deref());
    if !allowed {
        if head.first().is_some_and(|b| *b != 0x16) {
            let body = "blocked by the sandbox's network policy\n";
            let resp = format!(
                "HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = conn.write_all(resp.as_bytes()).await;
        }
        return Err(std::io::Error::other(format!(
            "refused {dst} ({})",
            name.as_deref().unwrap_or("no name")
        )));
    }
    let dst = match name.as_deref() {
        Some(n) if !egress.policy.allows(&egress.site, *dst.ip(), None) => {
            match egress.named_destination(dst, n).await {
                Ok(to) => to,
                Err(e) => {
                    if head.first().is_some_and(|b| *b != 0x16) {
                        let body = format!("{e}\n");
                        let resp = format!(
                            "HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                            body.len()
                        );
                        let _ = conn.write_all(resp.as_bytes()).await;
                    }
                    return Err(std::io::Error::other(format!("refused {dst} ({n}): {e}")));
                }
            }
        }
        _ => dst,
    };
    if egress
        .policy
        .transforms
        .intercepts(*dst.ip(), name.as_deref())
    {
        return match inject {
            Some(inject) => super::inject::serve(conn, head, dst, name, egress, inject).await,
            None => Err(std::io::Error::other(
                "header transforms need the egress CA, which this server has not",
            )),
        };
    }
    let mut upstream = tokio::time::timeout(DIAL_TIMEOUT, egress.dial(dst))
        .await
        .map_err(|_| std::io::Error::other(format!("dialling {dst} timed out")))??;
    upstream.write_all(&head).await?;
    tokio::io::copy_bidirectional(&mut conn, &mut upstream).await?;
    Ok(())
}
