//! `POST /files`: write one file into the guest (a raw upload).

use std::future::Future;

use bytes::Bytes;
use http_body_util::Full;
use hyper::Request;

use crate::{AgentError, Result};

const WHAT: &str = "file upload";

/// Write `data` to `path` in the guest as `user` (parents are created; an
/// existing file is replaced), on the connection `conn` opens.
pub async fn write(
    conn: impl Future<Output = std::io::Result<tokio::net::TcpStream>>,
    user: &str,
    path: &str,
    data: Bytes,
    token: Option<&str>,
) -> Result<()> {
    let query = url_encode(path);
    let basic = base64::Engine::encode(
        &base64::engine::general_purpose::STANDARD,
        format!("{user}:"),
    );
    let mut req = Request::post(format!("/files?path={query}&username={user}"))
        .header("host", "agent")
        .header("content-type", "application/octet-stream")
        .header("authorization", format!("Basic {basic}"));
    if let Some(t) = token {
        req = req.header("x-access-token", t);
    }
    let req = req
        .body(Full::new(data))
        .map_err(|e| AgentError::Protocol {
            what: WHAT,
            detail: e.to_string(),
        })?;
    let (status, body) = crate::http1::request(conn, req)
        .await
        .map_err(|source| AgentError::Io { what: WHAT, source })?;
    if !status.is_success() {
        return Err(AgentError::Status {
            what: WHAT,
            status: status.as_u16(),
            body: String::from_utf8_lossy(&body).into_owned(),
        });
    }
    Ok(())
}

/// Percent-encode everything but unreserved characters and `/`.
fn url_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn encodes_a_query_value() {
        assert_eq!(super::url_encode("/tmp/a b&c=d"), "/tmp/a%20b%26c%3Dd");
    }
}
