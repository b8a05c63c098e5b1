//! The host's client of `tine-agent` (the envd API in every guest).
//!
//! Every call takes `conn`, the future that opens its TCP connection to the
//! guest (for example `guest.connect(AGENT_PORT)` of the VM driver), so
//! this crate knows HTTP and Connect but nothing of VMs or namespaces.
//!
//! - [`init`]: `POST /init`, the guest's identity after every restore
//!   ([`InitRequest`], the same type the agent parses);
//! - [`healthy`]: one readiness probe (`GET /health`);
//! - [`metrics`]: `GET /metrics`;
//! - [`process`]: `process.Process/Start` as `commands.run` sends it, on a
//!   fresh or a kept-alive connection.

pub mod files;
mod http1;
mod init;
pub mod process;

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::Request;
use serde::Deserialize;

pub use init::{init, GuestMount, InitRequest};
pub use process::ExecOutput;

/// The agent's port (the one E2B's envd uses).
pub const AGENT_PORT: u16 = 49983;

/// The envd version the agent implements and advertises to the SDKs (they
/// enable features by it: 0.5.2 `close_stdin`, 0.5.7 raw uploads, 0.6.2
/// file metadata, 0.6.3 entries in watch events, 0.6.4 the network-mount
/// watch option).
pub const ENVD_VERSION: &str = "0.6.4";

/// How long one call (connect, request and answer) may take.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("the agent did not answer {what} within {secs} s")]
    Timeout { what: &'static str, secs: u64 },
    #[error("{what}: {source}")]
    Io {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{what} answered {status}: {body}")]
    Status {
        what: &'static str,
        status: u16,
        body: String,
    },
    #[error("{what}: {detail}")]
    Protocol { what: &'static str, detail: String },
}

pub type Result<T, E = AgentError> = std::result::Result<T, E>;

/// One request on the connection `conn` opens, bounded by `timeout`;
/// a non-2xx answer is an error.
async fn call(
    what: &'static str,
    conn: impl Future<Output = std::io::Result<tokio::net::TcpStream>>,
    req: Request<Full<Bytes>>,
    timeout: Duration,
) -> Result<Bytes> {
    let (status, body) = tokio::time::timeout(timeout, http1::request(conn, req))
        .await
        .map_err(|_| AgentError::Timeout {
            what,
            secs: timeout.as_secs(),
        })?
        .map_err(|source| AgentError::Io { what, source })?;
    if !status.is_success() {
        return Err(AgentError::Status {
            what,
            status: status.as_u16(),
            body: String::from_utf8_lossy(&body).into_owned(),
        });
    }
    Ok(body)
}

/// How long one readiness probe may take in all. Short: a SYN the booting
/// guest dropped is resent by the kernel only after a second, so the
/// caller retries sooner instead.
const PROBE_TIMEOUT: Duration = Duration::from_millis(300);
/// Once connected, how long `/health` may take to answer.
const PROBE_ANSWER: Duration = Duration::from_secs(2);

/// One readiness probe: `GET /health` answered with a 2xx.
pub async fn healthy(conn: impl Future<Output = std::io::Result<tokio::net::TcpStream>>) -> bool {
    let Ok(Ok(stream)) = tokio::time::timeout(PROBE_TIMEOUT, conn).await else {
        return false;
    };
    let req = get("/health", None);
    let connected = async move { Ok(stream) };
    call("/health", connected, req, PROBE_ANSWER).await.is_ok()
}

fn get(path: &str, token: Option<&str>) -> Request<Full<Bytes>> {
    let mut req = Request::get(path).header("host", "agent");
    if let Some(t) = token {
        req = req.header("x-access-token", t);
    }
    req.body(Full::new(Bytes::new()))
        .expect("a GET with valid headers")
}

/// The agent's `GET /metrics` body.
#[derive(Debug, Clone, Deserialize)]
pub struct AgentMetrics {
    /// Unix seconds.
    pub ts: i64,
    pub cpu_count: u64,
    pub cpu_used_pct: f64,
    pub mem_total: u64,
    pub mem_used: u64,
    #[serde(default)]
    pub mem_cache: u64,
    pub disk_used: u64,
    pub disk_total: u64,
}

/// `GET /metrics` with the sandbox's access token.
pub async fn metrics(
    conn: impl Future<Output = std::io::Result<tokio::net::TcpStream>>,
    token: &str,
) -> Result<AgentMetrics> {
    let body = call("/metrics", conn, get("/metrics", Some(token)), CALL_TIMEOUT).await?;
    serde_json::from_slice(&body).map_err(|e| AgentError::Protocol {
        what: "/metrics",
        detail: format!("body: {e}"),
    })
}
