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
        .map_err(|_| {
            std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "connect to the agent timed out",
            )
        })?
}

/// How long a call to a running agent may take to connect. Generous: on a
/// loaded host (many guests under TCG) the guest's answer to a SYN can take
/// seconds.
const CALL_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// A readiness probe gives up sooner and is retried instead (a SYN the
/// booting guest dropped is resent by the kernel only after a second).
const PROBE_CONNECT_TIMEOUT: Duration = Duration::from_millis(300);

/// One HTTP/1.1 request on a fresh connection; returns status and body.
pub async fn request(
    netns: &Netns,
    req: Request<Full<Bytes>>,
) -> std::io::Result<(StatusCode, Bytes)> {
    request_with(netns, req, CALL_CONNECT_TIMEOUT).await
}

async fn request_with(
    netns: &Netns,
    req: Request<Full<Bytes>>,
    connect_timeout: Duration,
) -> std::io::Result<(StatusCode, Bytes)> {
    let stream = connect(netns, connect_timeout).await?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(std::io::Error::other)?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let resp = sender
        .send_request(req)
        .await
        .map_err(std::io::Error::other)?;
    let status = resp.status();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(std::io::Error::other)?
        .to_bytes();
    Ok((status, body))
}

/// `GET /health` answered with a 2xx.
pub async fn healthy(netns: &Netns) -> bool {
    let req = Request::get("/health")
        .header("host", "agent")
        .body(Full::new(Bytes::new()))
        .expect("static request is valid");
    matches!(
        tokio::time::timeout(Duration::from_secs(2), request_with(netns, req, PROBE_CONNECT_TIMEOUT)).await,
        Ok(Ok((s, _))) if s.is_success()
    )
}

/// Poll `/health` until it answers, `give_up` returns true, or `timeout`
/// passes. Returns whether the agent answered.
pub async fn wait_healthy(
    netns: &Netns,
    timeout: Duration,
    mut give_up: impl FnMut() -> bool,
) -> bool {
    let deadline = Instant::now() + timeout;
    let mut delay = Duration::from_millis(1);
    let start = Instant::now();
    while Instant::now() < deadline {
        let t = Instant::now();
        let ok = healthy(netns).await;
        tracing::trace!(
            ok,
            attempt_ms = t.elapsed().as_secs_f64() * 1e3,
            since_ms = start.elapsed().as_secs_f64() * 1e3,
            "health probe"
        );
        if ok {
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

/// What a command run through the agent produced.
#[derive(Debug, Clone, Default)]
pub struct ExecOutput {
    pub pid: u32,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub exit_code: i32,
    pub status: String,
}

/// The request the E2B SDK's `commands.run(cmd)` makes: `bash -l -c cmd`
/// as `user` through `process.Process/Start`, with `timeout` as the
/// process deadline and the sandbox's access token if it has one.
pub fn start_request(
    user: &str,
    cmd: &str,
    token: Option<&str>,
    timeout: Duration,
) -> Request<Full<Bytes>> {
    use base64::Engine as _;
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
    req.body(Full::new(body)).expect("request is valid")
}

/// Decode the answer to [`start_request`]: the process's output and end.
pub fn parse_start_response(status: StatusCode, body: &[u8]) -> Result<ExecOutput, String> {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD;
    if status != StatusCode::OK {
        let err = tine_connect::Error::from_unary_response(status.as_u16(), body);
        return Err(format!("HTTP {status}: {err}"));
    }
    let mut decoder = tine_connect::Decoder::new(64 << 20);
    decoder.push(body);
    let mut out = ExecOutput::default();
    let mut ended = false;
    while let Some(frame) = decoder.next_frame().map_err(|e| e.to_string())? {
        match frame {
            tine_connect::Frame::Message(json) => {
                let msg: serde_json::Value =
                    serde_json::from_slice(&json).map_err(|e| e.to_string())?;
                let event = &msg["event"];
                if let Some(start) = event.get("start") {
                    out.pid = start["pid"].as_u64().unwrap_or(0) as u32;
                } else if let Some(data) = event.get("data") {
                    for (key, sink) in [("stdout", &mut out.stdout), ("stderr", &mut out.stderr)] {
                        if let Some(s) = data.get(key).and_then(|v| v.as_str()) {
                            sink.extend(b64.decode(s).map_err(|e| e.to_string())?);
                        }
                    }
                } else if let Some(end) = event.get("end") {
                    out.exit_code = end["exitCode"].as_i64().unwrap_or(0) as i32;
                    out.status = end["status"].as_str().unwrap_or_default().to_string();
                    ended = true;
                }
            }
            tine_connect::Frame::End(end) => end.into_result().map_err(|e| e.to_string())?,
        }
    }
    decoder.finish().map_err(|e| e.to_string())?;
    if !ended {
        return Err("the process stream ended without an end event".into());
    }
    Ok(out)
}

/// Run `cmd` with `bash -l -c` as `user` through the agent's
/// `process.Process/Start` (the call `commands.run` of the E2B SDK makes),
/// collecting its output until it ends or `timeout` passes.
pub async fn exec(
    netns: &Netns,
    user: &str,
    cmd: &str,
    timeout: Duration,
) -> Result<ExecOutput, String> {
    let req = start_request(user, cmd, None, timeout);
    let (status, body) =
        tokio::time::timeout(timeout + Duration::from_secs(5), request(netns, req))
            .await
            .map_err(|_| format!("no answer within {timeout:?}"))?
            .map_err(|e| format!("request failed: {e}"))?;
    parse_start_response(status, &body)
}
