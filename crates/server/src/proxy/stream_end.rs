//! A response body from a sandbox that ends when the sandbox leaves.
//!
//! When a sandbox is killed (or paused) its VM goes without closing its
//! connections, so a stream proxied out of it would hang until the client
//! gave up. The body ends instead, as E2B's proxy ends it: the client's
//! HTTP/1 connection is reset (TCP RST) mid-body. Every SDK version then
//! probes the sandbox's `/health`, gets 502 "The sandbox was not found"
//! and raises "the sandbox was killed or reached its end of life". A clean
//! Connect end-of-stream with `unavailable` would not do: Python 2.45 and
//! the JS SDK map it by its code to "likely due to sandbox timeout", and
//! Python 2.45 probes only after a reset, not after an orderly close (FIN).
//!
//! Where the connection cannot be reset (HTTP/2, whose other streams must
//! go on, or no socket known), a Connect stream gets the `unavailable`
//! end-of-stream message and any other body an error, which aborts it.
//! When the sandbox is still live and only its guest connection broke, a
//! Connect stream also gets that message.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame};
use tokio_util::sync::WaitForCancellationFutureOwned;

/// Connect's end-of-stream flag on an enveloped message.
const END_STREAM: u8 = 0x02;

pub struct EndsWithSandbox<B> {
    inner: B,
    token: tokio_util::sync::CancellationToken,
    gone: Pin<Box<WaitForCancellationFutureOwned>>,
    sandbox: String,
    connect_stream: bool,
    client: Option<ClientSocket>,
    done: bool,
}

impl<B> EndsWithSandbox<B> {
    /// `client`: the client's HTTP/1 connection, reset when the sandbox
    /// goes (`None` keeps it open and ends the body as described above).
    pub fn new(
        inner: B,
        gone: tokio_util::sync::CancellationToken,
        sandbox: String,
        connect_stream: bool,
        client: Option<ClientSocket>,
    ) -> Self {
        Self {
            inner,
            token: gone.clone(),
            gone: Box::pin(gone.cancelled_owned()),
            sandbox,
            connect_stream,
            client,
            done: false,
        }
    }
}

/// The socket of the client connection a request came on. Set by the
/// server for every connection (`ConnectInfo`), read by the proxy.
#[derive(Debug, Clone, Copy)]
pub struct ClientSocket(pub std::os::fd::RawFd);

/// The plain server's listener: TCP with `TCP_NODELAY` set at accept (its
/// answers are many small streamed writes), whose connections are known
/// by their socket ([`ClientSocket`], the `ConnectInfo` of a request).
pub struct TcpListener(pub tokio::net::TcpListener);

impl axum::serve::Listener for TcpListener {
    type Io = tokio::net::TcpStream;
    type Addr = ClientSocket;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            match self.0.accept().await {
                Ok((tcp, _)) => {
                    if let Err(e) = tcp.set_nodelay(true) {
                        tracing::debug!("TCP_NODELAY: {e}");
                    }
                    let fd = std::os::fd::AsRawFd::as_raw_fd(&tcp);
                    return (tcp, ClientSocket(fd));
                }
                Err(e) => {
                    // Out of file descriptors and the like: wait, go on.
                    tracing::warn!("accepting a connection: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(ClientSocket(std::os::fd::AsRawFd::as_raw_fd(&self.0)))
    }
}

impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, TcpListener>>
    for ClientSocket
{
    fn connect_info(stream: axum::serve::IncomingStream<'_, TcpListener>) -> Self {
        *stream.remote_addr()
    }
}

impl ClientSocket {
    /// Makes the socket's close a reset (SO_LINGER with a zero timeout):
    /// the connection task closes it as soon as this body fails.
    fn reset_on_close(self) -> bool {
        use nix::sys::socket::{setsockopt, sockopt::Linger};
        // SAFETY: the fd is the socket of the connection whose task is
        // polling this body, so it is open for the whole call (the task
        // owns the stream and closes it only after this poll returns).
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(self.0) };
        let linger = nix::libc::linger {
            l_onoff: 1,
            l_linger: 0,
        };
        setsockopt(&fd, Linger, &linger).is_ok()
    }
}

/// Whether a response's content type is a Connect stream.
pub fn is_connect_stream(headers: &http::HeaderMap) -> bool {
    headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| t.starts_with("application/connect+"))
}

/// The end-of-stream message of a Connect stream that failed.
pub fn end_stream_error(code: &str, message: &str) -> Bytes {
    let json = serde_json::json!({ "error": { "code": code, "message": message } }).to_string();
    let mut out = Vec::with_capacity(5 + json.len());
    out.push(END_STREAM);
    out.extend_from_slice(&(json.len() as u32).to_be_bytes());
    out.extend_from_slice(json.as_bytes());
    Bytes::from(out)
}

impl<B> EndsWithSandbox<B> {
    fn end(&mut self, why: &str) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        self.done = true;
        let message = format!(
            "the connection to sandbox {} ended before the stream completed: {why}",
            self.sandbox
        );
        if self.token.is_cancelled() {
            if let Some(client) = self.client.take() {
                if client.reset_on_close() {
                    return Poll::Ready(Some(Err(axum::Error::new(message))));
                }
            }
        }
        if self.connect_stream {
            Poll::Ready(Some(Ok(Frame::data(end_stream_error(
                "unavailable",
                &message,
            )))))
        } else {
            Poll::Ready(Some(Err(axum::Error::new(message))))
        }
    }
}

impl<B> Body for EndsWithSandbox<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        if self.done {
            return Poll::Ready(None);
        }
        if self.gone.as_mut().poll(cx).is_ready() {
            return self.end("the sandbox was stopped");
        }
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Err(e))) => {
                let why = e.to_string();
                self.end(&why)
            }
            Poll::Ready(Some(Ok(frame))) => Poll::Ready(Some(Ok(frame))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::SinkExt;
    use http_body_util::BodyExt;
    use std::future::IntoFuture;

    type Item = Result<Frame<Bytes>, std::convert::Infallible>;
    type Sender = futures::channel::mpsc::Sender<Item>;
    type Body = http_body_util::StreamBody<futures::channel::mpsc::Receiver<Item>>;

    /// A body whose frames the test sends.
    fn channel() -> (Sender, Body) {
        let (tx, rx) = futures::channel::mpsc::channel(4);
        (tx, http_body_util::StreamBody::new(rx))
    }

    /// Without a connection to reset (HTTP/2, unit tests).
    #[tokio::test]
    async fn a_stream_ends_with_an_unavailable_message_when_its_sandbox_goes() {
        let (mut tx, inner) = channel();
        let gone = tokio_util::sync::CancellationToken::new();
        let mut body = EndsWithSandbox::new(inner, gone.clone(), "isb".into(), true, None);
        tx.send(Ok(Frame::data(Bytes::from_static(b"first"))))
            .await
            .unwrap();
        let f = body.frame().await.unwrap().unwrap();
        assert_eq!(f.into_data().unwrap(), Bytes::from_static(b"first"));
        gone.cancel();
        let last = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(last[0], END_STREAM);
        let len = u32::from_be_bytes(last[1..5].try_into().unwrap()) as usize;
        let v: serde_json::Value = serde_json::from_slice(&last[5..5 + len]).unwrap();
        assert_eq!(v["error"]["code"], "unavailable");
        assert!(v["error"]["message"].as_str().unwrap().contains("isb"));
        assert!(body.frame().await.is_none());
    }

    #[tokio::test]
    async fn a_plain_body_fails_when_its_sandbox_goes() {
        let (_tx, inner) = channel();
        let gone = tokio_util::sync::CancellationToken::new();
        let mut body = EndsWithSandbox::new(inner, gone.clone(), "isb".into(), false, None);
        gone.cancel();
        assert!(body.frame().await.unwrap().is_err());
    }

    /// Over a real HTTP/1 connection: the client sees the first chunk, then
    /// a reset (not an orderly end) when the sandbox goes.
    #[tokio::test]
    async fn the_client_connection_is_reset_when_the_sandbox_goes() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let gone = tokio_util::sync::CancellationToken::new();
        let token = gone.clone();
        let app = axum::Router::new().route(
            "/stream",
            axum::routing::get(
                move |axum::extract::ConnectInfo(client): axum::extract::ConnectInfo<
                    ClientSocket,
                >| {
                    let gone = token.clone();
                    async move {
                        let (mut tx, inner) = channel();
                        tx.send(Ok(Frame::data(Bytes::from_static(b"first"))))
                            .await
                            .unwrap();
                        // Keep the sender: the body stays open until `gone`.
                        tokio::spawn(async move {
                            tokio::time::sleep(std::time::Duration::from_secs(30)).await;
                            drop(tx);
                        });
                        axum::body::Body::new(EndsWithSandbox::new(
                            inner,
                            gone,
                            "isb".into(),
                            true,
                            Some(client),
                        ))
                    }
                },
            ),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(
            axum::serve(
                TcpListener(listener),
                app.into_make_service_with_connect_info::<ClientSocket>(),
            )
            .into_future(),
        );
        let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
        conn.write_all(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        while !String::from_utf8_lossy(&seen).contains("first") {
            let n = conn.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed before the first chunk");
            seen.extend_from_slice(&buf[..n]);
        }
        gone.cancel();
        let end = tokio::time::timeout(std::time::Duration::from_secs(10), async {
            loop {
                match conn.read(&mut buf).await {
                    Ok(0) => return Ok(()),
                    Ok(_) => continue,
                    Err(e) => return Err(e),
                }
            }
        })
        .await
        .expect("the connection stayed open after the sandbox went");
        let err = end.expect_err("the connection ended in order, not by a reset");
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset, "{err}");
    }
}
