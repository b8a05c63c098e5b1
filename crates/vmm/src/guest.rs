//! Talking to the agent inside a VM over HTTP/1.1 (through the VM's network
//! namespace, see [`crate::netns::Netns::connect`]).

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;

use crate::netns::Netns;

/// The agent's port (the one E2B's envd uses).
pub const AGENT_PORT: u16 = 49983;

/// A new connection to the agent. A SYN the guest drops (it is still
/// booting) is retried by the kernel only after a second, so connects are
/// bounded by `timeout` and the callers retry sooner.
pub async fn connect(netns: &Netns, timeout: Duration) -> std::io::Result<tokio::net::TcpStream> {
    tokio::time::timeout(timeout, netns.connect(AGENT_PORT))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "connect to the agent timed out"))?
}

/// One HTTP/1.1 request on a fresh connection; returns status and body.
pub async fn request(netns: &Netns, req: Request<Full<Bytes>>) -> std::io::Result<(StatusCode, Bytes)> {
    let stream = connect(netns, Duration::from_millis(300)).await?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(std::io::Error::other)?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let resp = sender.send_request(req).await.map_err(std::io::Error::other)?;
    let status = resp.status();
    let body = resp.into_body().collect().await.map_err(std::io::Error::other)?.to_bytes();
    Ok((status, body))
}

/// `GET /health` answered with a 2xx.
pub async fn healthy(netns: &Netns) -> bool {
    let req = Request::get("/health")
        .header("host", "agent")
        .body(Full::new(Bytes::new()))
        .expect("static request is valid");
    matches!(
        tokio::time::timeout(Duration::from_secs(2), request(netns, req)).await,
        Ok(Ok((s, _))) if s.is_success()
    )
}

/// Poll `/health` until it answers, `give_up` returns true, or `timeout`
/// passes. Returns whether the agent answered.
pub async fn wait_healthy(netns: &Netns, timeout: Duration, mut give_up: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    let mut delay = Duration::from_millis(1);
    while Instant::now() < deadline {
        if healthy(netns).await {
            return true;
        }
        if give_up() {
            return false;
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_millis(25));
    }
    false
}
