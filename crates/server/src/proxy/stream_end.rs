//! A response body from a sandbox that ends when the sandbox leaves.
//!
//! When a sandbox is killed (or paused) its VM goes without closing its
//! connections, so a stream proxied out of it would hang until the client
//! gave up. The body ends instead: a Connect stream (`application/connect+…`)
//! with an end-of-stream message carrying an `unavailable` error, as E2B's
//! proxy does (the SDK then probes the sandbox, finds it gone and raises
//! "the sandbox was killed or reached its end of life"); any other body
//! with an error, which aborts the response.

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
    gone: Pin<Box<WaitForCancellationFutureOwned>>,
    sandbox: String,
    connect_stream: bool,
    done: bool,
}

impl<B> EndsWithSandbox<B> {
    pub fn new(
        inner: B,
        gone: tokio_util::sync::CancellationToken,
        sandbox: String,
        connect_stream: bool,
    ) -> Self {
        Self {
            inner,
            gone: Box::pin(gone.cancelled_owned()),
            sandbox,
            connect_stream,
            done: false,
        }
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

    type Item = Result<Frame<Bytes>, std::convert::Infallible>;
    type Sender = futures::channel::mpsc::Sender<Item>;
    type Body = http_body_util::StreamBody<futures::channel::mpsc::Receiver<Item>>;

    /// A body whose frames the test sends.
    fn channel() -> (Sender, Body) {
        let (tx, rx) = futures::channel::mpsc::channel(4);
        (tx, http_body_util::StreamBody::new(rx))
    }

    #[tokio::test]
    async fn a_stream_ends_with_an_unavailable_message_when_its_sandbox_goes() {
        let (mut tx, inner) = channel();
        let gone = tokio_util::sync::CancellationToken::new();
        let mut body = EndsWithSandbox::new(inner, gone.clone(), "isb".into(), true);
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
        let mut body = EndsWithSandbox::new(inner, gone.clone(), "isb".into(), false);
        gone.cancel();
        assert!(body.frame().await.unwrap().is_err());
    }
}
