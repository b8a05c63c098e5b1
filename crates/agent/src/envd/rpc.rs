//! Connect RPC on the server side: reading requests (unary JSON, one
//! enveloped message, a client stream), answering (unary JSON, a stream of
//! envelopes flushed one by one), and the per-call context (user, deadline,
//! keepalive interval) taken from the headers.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use futures::StreamExt;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tine_connect::{Decoder, EndStream};
use tokio::sync::mpsc;

use super::error::{EnvdError, Result};
use super::protobin::{self, Schema};
use super::user::User;
use super::Envd;

/// Largest request message accepted (a `SendInput` chunk is the biggest).
pub const MAX_MESSAGE: usize = 16 << 20;

/// What every handler gets.
pub struct Ctx {
    pub envd: Arc<Envd>,
    pub user: User,
    /// `Connect-Timeout-Ms`.
    pub timeout: Option<Duration>,
    /// `Keepalive-Ping-Interval` (seconds in the header).
    pub keepalive: Option<Duration>,
}

impl Ctx {
    pub fn new(envd: Arc<Envd>, headers: &HeaderMap) -> Result<Ctx> {
        let user = envd.user_from_headers(headers, None)?;
        let timeout = headers
            .get(tine_connect::HEADER_TIMEOUT_MS)
            .and_then(|v| v.to_str().ok())
            .and_then(tine_connect::parse_timeout_ms)
            .map(Duration::from_millis);
        let keepalive = headers
            .get("keepalive-ping-interval")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .filter(|s| *s > 0)
            .map(Duration::from_secs);
        Ok(Ctx {
            envd,
            user,
            timeout,
            keepalive,
        })
    }
}

/// The user named by `Authorization: Basic base64("user:")`, if any.
pub fn basic_auth_user(headers: &HeaderMap) -> Result<Option<String>> {
    let Some(value) = headers.get(header::AUTHORIZATION) else {
        return Ok(None);
    };
    let bad = || {
        EnvdError::Unauthenticated(
            "invalid Authorization header: expected Basic base64(\"user:\")".into(),
        )
    };
    let value = value.to_str().map_err(|_| bad())?;
    let (scheme, creds) = value.trim().split_once(' ').ok_or_else(bad)?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return Err(bad());
    }
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(creds.trim())
        .map_err(|_| bad())?;
    let decoded = String::from_utf8(decoded).map_err(|_| bad())?;
    let name = decoded.split_once(':').map(|(u, _)| u).unwrap_or(&decoded);
    Ok(Some(name.to_string()))
}

/// The media type of `Content-Type`, lower case, without parameters.
pub fn media_type(headers: &HeaderMap) -> String {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| {
            v.split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase()
        })
        .unwrap_or_default()
}

async fn read_body(body: Body) -> Result<Bytes> {
    axum::body::to_bytes(body, MAX_MESSAGE + 5)
        .await
        .map_err(|e| EnvdError::InvalidArgument(format!("reading the request: {e}")))
}

/// The codec of one call: proto3 JSON, or binary protobuf transcoded to and
/// from JSON at this edge (see [`super::protobin`]).
#[derive(Clone, Copy)]
pub struct Wire {
    /// Request content type without parameters.
    media: &'static str,
    /// Request and response schemas when the call is binary.
    proto: Option<(&'static Schema, &'static Schema)>,
    /// The request's messages are gzip-compressed (`Content-Encoding` on
    /// unary calls, `Connect-Content-Encoding` and flag 0x01 on streams).
    gzip: Encoding,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Encoding {
    Identity,
    Gzip,
    Unsupported,
}

fn encoding(headers: &HeaderMap, name: &str) -> Encoding {
    match headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim().to_ascii_lowercase())
    {
        None => Encoding::Identity,
        Some(v) if v.is_empty() || v == "identity" => Encoding::Identity,
        Some(v) if v == "gzip" => Encoding::Gzip,
        Some(_) => Encoding::Unsupported,
    }
}

/// Inflates a compressed message, refusing more than [`MAX_MESSAGE`] bytes.
fn gunzip(data: &[u8]) -> Result<Vec<u8>> {
    use std::io::Read;
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(data)
        .take(MAX_MESSAGE as u64 + 1)
        .read_to_end(&mut out)
        .map_err(|e| EnvdError::InvalidArgument(format!("invalid gzip message: {e}")))?;
    if out.len() > MAX_MESSAGE {
        return Err(EnvdError::InvalidArgument(format!(
            "message is larger than {MAX_MESSAGE} bytes once inflated"
        )));
    }
    Ok(out)
}

const MEDIA: [&str; 4] = [
    "application/json",
    "application/proto",
    "application/connect+json",
    "application/connect+proto",
];

impl Wire {
    /// The wire of a call whose request and response schemas (for the
    /// protobuf encoding) are `schemas`.
    pub fn new(headers: &HeaderMap, schemas: Option<(&'static Schema, &'static Schema)>) -> Wire {
        let got = media_type(headers);
        let media = if got.is_empty() {
            "application/json"
        } else {
            MEDIA.into_iter().find(|m| *m == got).unwrap_or("")
        };
        let proto = if media.ends_with("proto") {
            schemas
        } else {
            None
        };
        let gzip = if media.starts_with("application/connect+") {
            encoding(headers, "connect-content-encoding")
        } else {
            encoding(headers, "content-encoding")
        };
        Wire { media, proto, gzip }
    }

    fn check(&self, streaming: bool) -> Result<()> {
        let ok = match (streaming, self.media) {
            (false, "application/json") | (true, "application/connect+json") => true,
            (false, "application/proto") | (true, "application/connect+proto") => {
                self.proto.is_some()
            }
            _ => false,
        };
        if ok && self.gzip == Encoding::Unsupported {
            return Err(EnvdError::Unimplemented(
                "unsupported request compression (identity and gzip are)".into(),
            ));
        }
        if ok {
            return Ok(());
        }
        let want = if streaming {
            "application/connect+json or application/connect+proto"
        } else {
            "application/json or application/proto"
        };
        Err(EnvdError::UnsupportedMediaType(format!(
            "unsupported content type {:?}, expected {want}",
            self.media
        )))
    }

    fn parse<T: DeserializeOwned>(&self, payload: &[u8]) -> Result<T> {
        match self.proto {
            Some((req, _)) => {
                let json = protobin::decode(req, payload).map_err(|e| {
                    EnvdError::InvalidArgument(format!("invalid request message: {e}"))
                })?;
                serde_json::from_value(json).map_err(|e| {
                    EnvdError::InvalidArgument(format!("invalid request message: {e}"))
                })
            }
            None => parse_json(payload),
        }
    }

    fn encode<M: Serialize>(&self, msg: &M) -> Result<Vec<u8>> {
        let internal = |e: String| EnvdError::Internal(format!("encoding the response: {e}"));
        match self.proto {
            Some((_, resp)) => {
                let json = serde_json::to_value(msg).map_err(|e| internal(e.to_string()))?;
                protobin::encode(resp, &json).map_err(|e| internal(e.to_string()))
            }
            None => serde_json::to_vec(msg).map_err(|e| internal(e.to_string())),
        }
    }

    fn stream_content_type(&self) -> HeaderValue {
        HeaderValue::from_static(if self.proto.is_some() {
            "application/connect+proto"
        } else {
            tine_connect::CONTENT_TYPE_STREAM_JSON
        })
    }

    /// The message of a unary call.
    pub async fn read_unary<T: DeserializeOwned>(&self, body: Body) -> Result<T> {
        self.check(false)?;
        let body = read_body(body).await?;
        if self.gzip == Encoding::Gzip {
            return self.parse(&gunzip(&body)?);
        }
        self.parse(&body)
    }

    /// The payload of a message envelope, inflated if it is compressed.
    fn payload(&self, env: tine_connect::Envelope) -> Result<Bytes> {
        if env.flags & tine_connect::FLAG_COMPRESSED == 0 {
            return Ok(env.payload);
        }
        if self.gzip != Encoding::Gzip {
            return Err(EnvdError::InvalidArgument(
                "compressed message without Connect-Content-Encoding: gzip".into(),
            ));
        }
        gunzip(&env.payload).map(Bytes::from)
    }

    /// The single enveloped message of a server-streaming call.
    pub async fn read_stream_request<T: DeserializeOwned>(&self, body: Body) -> Result<T> {
        self.check(true)?;
        let bytes = read_body(body).await?;
        let mut dec = Decoder::new(MAX_MESSAGE);
        dec.push(&bytes);
        let env = dec
            .next_envelope()
            .map_err(|e| EnvdError::InvalidArgument(e.to_string()))?;
        let msg = match env {
            Some(env) if env.flags & tine_connect::FLAG_END_STREAM == 0 => self.payload(env)?,
            _ => {
                dec.finish()
                    .map_err(|e| EnvdError::InvalidArgument(e.to_string()))?;
                return Err(EnvdError::InvalidArgument("request has no message".into()));
            }
        };
        match dec.next_envelope() {
            Ok(None) => dec
                .finish()
                .map_err(|e| EnvdError::InvalidArgument(e.to_string()))?,
            _ => {
                return Err(EnvdError::InvalidArgument(
                    "server-streaming request has more than one message".into(),
                ))
            }
        }
        self.parse(&msg)
    }

    /// Reads a client stream message by message.
    pub fn client_stream(&self, body: Body) -> Result<ClientStream> {
        self.check(true)?;
        Ok(ClientStream {
            wire: *self,
            body: body.into_data_stream(),
            dec: Decoder::new(MAX_MESSAGE),
            done: false,
        })
    }

    /// A unary answer: the message, or the Connect error JSON (always JSON,
    /// whatever the codec) with the code's HTTP status.
    pub fn unary_response<R: Serialize>(&self, result: Result<R>) -> Response {
        match result.and_then(|msg| self.encode(&msg)) {
            Ok(body) => {
                let ct = if self.proto.is_some() {
                    "application/proto"
                } else {
                    "application/json"
                };
                let mut resp = Response::new(Body::from(body));
                resp.headers_mut()
                    .insert(header::CONTENT_TYPE, HeaderValue::from_static(ct));
                resp
            }
            Err(e) => unary_error(&e),
        }
    }

    /// A streaming response (always HTTP 200) and its sender.
    pub fn stream_response(&self) -> (StreamTx, Response) {
        // A small channel keeps backpressure: a slow client slows the producer.
        let (tx, rx) = mpsc::channel::<Bytes>(8);
        let body = futures::stream::unfold(rx, |mut rx| async move {
            rx.recv()
                .await
                .map(|b| (Ok::<_, std::convert::Infallible>(b), rx))
        });
        let mut resp = Response::new(Body::from_stream(body));
        resp.headers_mut()
            .insert(header::CONTENT_TYPE, self.stream_content_type());
        (StreamTx { tx, wire: *self }, resp)
    }

    /// A stream that fails before its first message: 200 with only the
    /// end-of-stream error (what connect-go does), except for content types
    /// we do not speak, which get 415.
    pub fn stream_error(&self, err: EnvdError) -> Response {
        if let EnvdError::UnsupportedMediaType(_) = err {
            return (StatusCode::UNSUPPORTED_MEDIA_TYPE, err.to_string()).into_response();
        }
        let frame = tine_connect::encode_end_stream(&EndStream::err(err.to_connect()));
        let mut resp = Response::new(Body::from(frame));
        resp.headers_mut()
            .insert(header::CONTENT_TYPE, self.stream_content_type());
        resp
    }
}

fn parse_json<T: DeserializeOwned>(payload: &[u8]) -> Result<T> {
    let payload: &[u8] = if payload.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        payload
    };
    serde_json::from_slice(payload)
        .map_err(|e| EnvdError::InvalidArgument(format!("invalid request message: {e}")))
}

/// Reads the messages of a client stream one by one.
pub struct ClientStream {
    wire: Wire,
    body: axum::body::BodyDataStream,
    dec: Decoder,
    done: bool,
}

impl ClientStream {
    /// The next message; `Ok(None)` at the end of the stream.
    pub async fn next<T: DeserializeOwned>(&mut self) -> Result<Option<T>> {
        let bad = |e: tine_connect::FrameError| EnvdError::InvalidArgument(e.to_string());
        loop {
            match self.dec.next_envelope().map_err(bad)? {
                Some(env) if env.flags & tine_connect::FLAG_END_STREAM != 0 => {
                    self.done = true;
                    return Ok(None);
                }
                Some(env) => return self.wire.parse(&self.wire.payload(env)?).map(Some),
                None if self.done => {
                    self.dec.finish().map_err(bad)?;
                    return Ok(None);
                }
                None => match self.body.next().await {
                    Some(Ok(chunk)) => self.dec.push(&chunk),
                    Some(Err(e)) => {
                        return Err(EnvdError::InvalidArgument(format!(
                            "reading the request: {e}"
                        )))
                    }
                    None => self.done = true,
                },
            }
        }
    }
}

/// The error answer of a unary call (JSON `{code, message}` and the code's
/// HTTP status; 415 for a content type we do not speak).
/// A unary call: the caller's context (or why there is none), the decoded
/// request, then `f`.
pub async fn unary<Req, Resp, F, Fut>(
    ctx: Result<Ctx>,
    wire: &Wire,
    body: Body,
    f: F,
) -> Result<Resp>
where
    Req: DeserializeOwned,
    F: FnOnce(Ctx, Req) -> Fut,
    Fut: std::future::Future<Output = Result<Resp>>,
{
    let ctx = ctx?;
    let req = wire.read_unary(body).await?;
    f(ctx, req).await
}

pub fn unary_error(err: &EnvdError) -> Response {
    if let EnvdError::UnsupportedMediaType(_) = err {
        return (StatusCode::UNSUPPORTED_MEDIA_TYPE, err.to_string()).into_response();
    }
    let status =
        StatusCode::from_u16(err.code().http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut resp = Response::new(Body::from(err.to_connect().to_json()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

/// Sending half of a streaming response. Each message is one envelope,
/// handed to hyper as its own body chunk so it is flushed at once.
pub struct StreamTx {
    tx: mpsc::Sender<Bytes>,
    wire: Wire,
}

/// The client went away (the response body was dropped).
#[derive(Debug)]
pub struct Disconnected;

impl StreamTx {
    pub async fn send<M: Serialize>(&self, msg: &M) -> Result<(), Disconnected> {
        let payload = match self.wire.encode(msg) {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(%e, "dropping a stream message that cannot be encoded");
                return Ok(());
            }
        };
        self.tx
            .send(tine_connect::encode_envelope(0, &payload))
            .await
            .map_err(|_| Disconnected)
    }

    /// Ends the stream with the end-of-stream message.
    pub async fn finish(self, result: Result<()>) {
        let end = match result {
            Ok(()) => EndStream::ok(),
            Err(e) => EndStream::err(e.to_connect()),
        };
        let _ = self.tx.send(tine_connect::encode_end_stream(&end)).await;
    }

    /// Resolves when the client has gone away.
    pub async fn closed(&self) {
        self.tx.closed().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn basic_auth() {
        let mut h = HeaderMap::new();
        assert_eq!(basic_auth_user(&h).unwrap(), None);
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Basic cm9vdDo="),
        ); // "root:"
        assert_eq!(basic_auth_user(&h).unwrap().as_deref(), Some("root"));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer x"));
        assert!(basic_auth_user(&h).is_err());
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Basic !!!"));
        assert!(basic_auth_user(&h).is_err());
    }
}
