//! One HTTP/1.1 exchange on a fresh connection.

use std::future::Future;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;

/// The most a guest's answer to one request may hold; a guest that sends
/// more gets an error, not the host's memory.
pub const MAX_RESPONSE_BYTES: usize = 64 << 20;

/// Send `req` on the connection `conn` opens; returns status and body (at
/// most [`MAX_RESPONSE_BYTES`]).
pub async fn request(
    conn: impl Future<Output = std::io::Result<tokio::net::TcpStream>>,
    req: Request<Full<Bytes>>,
) -> std::io::Result<(StatusCode, Bytes)> {
    let stream = conn.await?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(std::io::Error::other)?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    let resp = sender
        .send_request(req)
        .await
        .map_err(std::io::Error::other)?;
    let status = resp.status();
    let body = http_body_util::Limited::new(resp.into_body(), MAX_RESPONSE_BYTES)
        .collect()
        .await
        .map_err(|e| std::io::Error::other(format!("reading the guest's answer: {e}")))?
        .to_bytes();
    Ok((status, body))
}
