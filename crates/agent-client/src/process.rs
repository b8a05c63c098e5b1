//! `process.Process/Start` at the wire level, as the E2B SDK's
//! `commands.run(cmd)` sends it: `bash -l -c cmd` as a user, a Connect
//! server stream of start, data and end events in reply.

use std::future::Future;
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;

use crate::{AgentError, Result};

const WHAT: &str = "process.Process/Start";

/// What a command run through the agent produced.
#[derive(Debug, Clone, Default)]
pub struct ExecOutput {
    pub pid: u32,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub exit_code: i32,
    pub status: String,
}

/// The request `commands.run(cmd)` makes: `bash -l -c cmd` as `user`, with
/// `timeout` as the process deadline and the sandbox's access token if it
/// has one.
pub fn start_request(
    user: &str,
    cmd: &str,
    token: Option<&str>,
    timeout: Duration,
) -> Request<Full<Bytes>> {
    let body = tine_connect::encode_message(&serde_json::json!({
        "process": { "cmd": "/bin/bash", "args": ["-l", "-c", cmd] },
        "stdin": false,
    }))
    .expect("a json! value serializes");
    let basic = base64::engine::general_purpose::STANDARD.encode(format!("{user}:"));
    let mut req = Request::post("/process.Process/Start")
        .header("host", "agent")
        .header("content-type", tine_connect::CONTENT_TYPE_STREAM_JSON)
        .header(
            tine_connect::HEADER_TIMEOUT_MS,
            timeout.as_millis().to_string(),
        )
        .header("authorization", format!("Basic {basic}"));
    if let Some(t) = token {
        req = req.header("x-access-token", t);
    }
    req.body(Full::new(body))
        .expect("a request with valid headers")
}

fn protocol(detail: impl ToString) -> AgentError {
    AgentError::Protocol {
        what: WHAT,
        detail: detail.to_string(),
    }
}

/// Decode the answer to [`start_request`]: the process's output and end.
pub fn parse_start_response(status: StatusCode, body: &[u8]) -> Result<ExecOutput> {
    if status != StatusCode::OK {
        let err = tine_connect::Error::from_unary_response(status.as_u16(), body);
        return Err(AgentError::Status {
            what: WHAT,
            status: status.as_u16(),
            body: err.to_string(),
        });
    }
    let mut decoder = tine_connect::Decoder::new(64 << 20);
    decoder.push(body);
    let mut out = ExecOutput::default();
    let mut ended = false;
    while let Some(frame) = decoder.next_frame().map_err(protocol)? {
        match frame {
            tine_connect::Frame::Message(json) => {
                let msg: serde_json::Value = serde_json::from_slice(&json).map_err(protocol)?;
                ended |= apply_event(&msg["event"], &mut out)?;
            }
            tine_connect::Frame::End(end) => end.into_result().map_err(protocol)?,
        }
    }
    decoder.finish().map_err(protocol)?;
    if !ended {
        return Err(protocol("the process stream ended without an end event"));
    }
    Ok(out)
}

/// Add one process event to `out`; true for the end event.
/// Output kept per stream of one command; what a guest prints beyond it is
/// dropped (the command still runs to its end).
pub const MAX_OUTPUT_BYTES: usize = 16 << 20;

fn apply_event(event: &serde_json::Value, out: &mut ExecOutput) -> Result<bool> {
    let b64 = base64::engine::general_purpose::STANDARD;
    if let Some(start) = event.get("start") {
        out.pid = start["pid"].as_u64().unwrap_or(0) as u32;
    } else if let Some(data) = event.get("data") {
        for (key, sink) in [("stdout", &mut out.stdout), ("stderr", &mut out.stderr)] {
            if let Some(s) = data.get(key).and_then(|v| v.as_str()) {
                let bytes = b64.decode(s).map_err(protocol)?;
                let room = MAX_OUTPUT_BYTES.saturating_sub(sink.len());
                sink.extend_from_slice(&bytes[..bytes.len().min(room)]);
            }
        }
    } else if let Some(end) = event.get("end") {
        out.exit_code = end["exitCode"].as_i64().unwrap_or(0) as i32;
        out.status = end["status"].as_str().unwrap_or_default().to_string();
        return Ok(true);
    }
    Ok(false)
}

/// Run `cmd` with `bash -l -c` as `user` on the connection `conn` opens,
/// collecting its output until it ends or `timeout` passes.
pub async fn exec(
    conn: impl Future<Output = std::io::Result<tokio::net::TcpStream>>,
    user: &str,
    cmd: &str,
    token: Option<&str>,
    timeout: Duration,
) -> Result<ExecOutput> {
    let req = start_request(user, cmd, token, timeout);
    let (status, body) = tokio::time::timeout(
        timeout + Duration::from_secs(5),
        crate::http1::request(conn, req),
    )
    .await
    .map_err(|_| AgentError::Timeout {
        what: WHAT,
        secs: timeout.as_secs(),
    })?
    .map_err(|source| AgentError::Io { what: WHAT, source })?;
    parse_start_response(status, &body)
}

/// A kept-alive HTTP/1.1 connection straight to one agent.
pub struct Direct {
    sender: SendRequest<Full<Bytes>>,
}

impl Direct {
    pub async fn connect(
        conn: impl Future<Output = std::io::Result<tokio::net::TcpStream>>,
    ) -> Result<Self> {
        let io = |source| AgentError::Io { what: WHAT, source };
        let stream = conn.await.map_err(io)?;
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| io(std::io::Error::other(e)))?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(Self { sender })
    }

    /// [`exec`] on this connection, with the sandbox's token, as `user`.
    pub async fn exec(&mut self, cmd: &str, token: &str, timeout: Duration) -> Result<ExecOutput> {
        let io = |e: hyper::Error| AgentError::Io {
            what: WHAT,
            source: std::io::Error::other(e),
        };
        let req = start_request("user", cmd, Some(token), timeout);
        self.sender.ready().await.map_err(io)?;
        let resp = tokio::time::timeout(timeout, self.sender.send_request(req))
            .await
            .map_err(|_| AgentError::Timeout {
                what: WHAT,
                secs: timeout.as_secs(),
            })?
            .map_err(io)?;
        let status = resp.status();
        let body = read_limited(resp.into_body(), crate::http1::MAX_RESPONSE_BYTES).await?;
        parse_start_response(status, &body)
    }
}

/// A whole body of at most `max` bytes (a guest that sends more gets an
/// error, not the host's memory).
async fn read_limited(body: hyper::body::Incoming, max: usize) -> Result<Bytes> {
    Ok(http_body_util::Limited::new(body, max)
        .collect()
        .await
        .map_err(|e| AgentError::Io {
            what: WHAT,
            source: std::io::Error::other(format!("reading the guest's answer: {e}")),
        })?
        .to_bytes())
}

/// [`exec`] (as root or any user, no token), handing each piece of output
/// to `on_output(stdout, stderr)` as it arrives, for callers that show a
/// long command's progress (template builds).
pub async fn exec_streaming(
    conn: impl Future<Output = std::io::Result<tokio::net::TcpStream>>,
    user: &str,
    cmd: &str,
    timeout: Duration,
    on_output: &mut (dyn FnMut(&[u8], &[u8]) + Send),
) -> Result<ExecOutput> {
    let io = |e: hyper::Error| AgentError::Io {
        what: WHAT,
        source: std::io::Error::other(e),
    };
    let req = start_request(user, cmd, None, timeout);
    let run = async {
        let stream = conn
            .await
            .map_err(|source| AgentError::Io { what: WHAT, source })?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(io)?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        let resp = sender.send_request(req).await.map_err(io)?;
        let status = resp.status();
        let mut body = resp.into_body();
        if status != StatusCode::OK {
            let bytes = read_limited(body, 1 << 20).await?;
            return parse_start_response(status, &bytes);
        }
        let mut decoder = tine_connect::Decoder::new(64 << 20);
        let mut out = ExecOutput::default();
        let mut ended = false;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(io)?;
            let Some(data) = frame.data_ref() else {
                continue;
            };
            decoder.push(data);
            while let Some(frame) = decoder.next_frame().map_err(protocol)? {
                match frame {
                    tine_connect::Frame::Message(json) => {
                        let msg: serde_json::Value =
                            serde_json::from_slice(&json).map_err(protocol)?;
                        let (o, e) = (out.stdout.len(), out.stderr.len());
                        ended |= apply_event(&msg["event"], &mut out)?;
                        if out.stdout.len() > o || out.stderr.len() > e {
                            on_output(&out.stdout[o..], &out.stderr[e..]);
                        }
                    }
                    tine_connect::Frame::End(end) => end.into_result().map_err(protocol)?,
                }
            }
        }
        decoder.finish().map_err(protocol)?;
        if !ended {
            return Err(protocol("the process stream ended without an end event"));
        }
        Ok(out)
    };
    tokio::time::timeout(timeout + Duration::from_secs(5), run)
        .await
        .map_err(|_| AgentError::Timeout {
            what: WHAT,
            secs: timeout.as_secs(),
        })?
}
