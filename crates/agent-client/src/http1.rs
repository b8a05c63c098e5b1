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

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// A one-shot HTTP server on loopback that answers with `len` bytes.
    async fn answer_with(len: usize) -> std::net::SocketAddr {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf).await;
            let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {len}\r\n\r\n");
            let _ = s.write_all(head.as_bytes()).await;
            let chunk = vec![b'x'; 1 << 20];
            let mut left = len;
            while left > 0 {
                let n = left.min(chunk.len());
                if s.write_all(&chunk[..n]).await.is_err() {
                    return;
                }
                left -= n;
            }
        });
        addr
    }

    fn get() -> Request<Full<Bytes>> {
        Request::get("/")
            .header("host", "x")
            .body(Full::new(Bytes::new()))
            .unwrap()
    }

    #[tokio::test]
    async fn a_guest_answer_larger_than_the_bound_is_an_error() {
        let ok = answer_with(1000).await;
        let (status, body) = request(tokio::net::TcpStream::connect(ok), get())
            .await
            .unwrap();
        assert_eq!((status, body.len()), (StatusCode::OK, 1000));
        let big = answer_with(MAX_RESPONSE_BYTES + 1).await;
        let err = request(tokio::net::TcpStream::connect(big), get())
            .await
            .unwrap_err();
        assert!(
            err.to_string().contains("reading the guest's answer"),
            "{err}"
        );
    }
}
